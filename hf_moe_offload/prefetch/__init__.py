"""Expert prefetching: SiDA-style hash predictors of routing, and their training."""
