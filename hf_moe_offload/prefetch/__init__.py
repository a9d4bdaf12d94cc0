"""Expert prefetching at inference time: SiDA-style hash predictors of routing (`hash_predictor`) and the hook that
loads their predicted experts ahead of the forward (`hash_runner`). Training them: `hf_moe_offload.training`."""
