"""Models: the seam the engines use, the architectures, checkpoint loading and tokenizers."""
