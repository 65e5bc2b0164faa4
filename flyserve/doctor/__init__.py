"""`flyserve doctor`: the first command an operator runs on a new machine.

``checks`` says, each as ok / warn / fail with the fix, whether flyserve, vLLM and the kernel pair
of this platform are usable and whether `vllm serve` would load flyserve; ``timing`` (``--run``)
times one small call of each path of the pair against a torch reference on a GPU.
"""
