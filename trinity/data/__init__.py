"""Training data: local jsonl/parquet readers, SFT tokenisation with loss masks, packing, samplers.

Modules: `readers` (records with file:line errors), `sft` (samples + loss masks), `packing` (rows,
block-causal masks, cu_seqlens), `loader` (`build_sft_data`, resumable DP-sharded sampler),
`prompts` (`build_prompt_data` for RL). Import them directly; this package imports nothing heavy.
"""
