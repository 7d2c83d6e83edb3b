python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
PT="python -m pytest -p no:cacheprovider -n 0 -q -s -ra --timeout 380"
(CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/partial_schedule.py --device cuda --shape 0.5b --staleness 1,3 --over-sampling 256 --calls 5 > $OUT/bench.log 2>&1; echo "bench rc $?" >> $OUT/bench.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 200 $PT tests/gpu/test_workflow_gpu.py -k cuda tests/gpu/test_rl_gpu.py > $OUT/one_gpu_tests.log 2>&1; echo "one-gpu tests rc $?" >> $OUT/one_gpu_tests.log) &
wait
grep -A8 "^64 prompts" $OUT/bench.log; tail -3 $OUT/bench.log
tail -5 $OUT/one_gpu_tests.log
CUDA_VISIBLE_DEVICES=0,1 timeout 380 $PT tests/gpu/test_workflow_gpu.py::test_guess_number_grpo_at_dp2 "tests/gpu/test_scale_gpu.py::test_rl_dp2[grpo]" tests/gpu/test_partial_gpu.py > $OUT/two_gpu_tests.log 2>&1; echo "two-gpu tests rc $?" >> $OUT/two_gpu_tests.log
grep -E "passed|failed|error|seed|val reward|workflow dp2|rc " $OUT/two_gpu_tests.log | tail -20
