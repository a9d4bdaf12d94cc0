"""Expert prefetching at inference time: SiDA-style hash predictors of routing and the hook that loads their
predicted experts ahead of the forward (`prefetch.hash`). Training them: `hf_moe_offload.training`."""
