"""flyserve.vllm"""
