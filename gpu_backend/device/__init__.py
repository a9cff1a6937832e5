"""Device side: the KV pool, its page watch, the fp32 reference and the CUDA graphs (torch)."""
