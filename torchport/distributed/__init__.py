"""torchport.distributed (partial during development)."""
