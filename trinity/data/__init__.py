"""Training data: local jsonl/parquet readers, SFT tokenisation with loss masks, packing, samplers.

Modules: `readers` (records with file:line errors), `sft` (samples + loss masks), `packing` (rows,
block-causal masks, cu_seqlens), `loader` (`build_sft_data` / `sft_data_from_job`: rows with a
resumable DP-sharded sampler), `prompts` (`build_prompt_data` / `prompt_data_from_job` for RL).
Import them directly; this package imports nothing heavy.
"""
