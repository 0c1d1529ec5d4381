"""Decoding on several processes with torch.distributed: tensor parallelism (docs/parallel.md).

`group` starts and joins the process group (gloo on CPUs, NCCL on GPUs; `torchrun` or ranks this process spawns);
`tensor` splits a model's heads, MLP columns and vocabulary across the ranks; `mirror` keeps every rank's runs in
step with rank 0's, where the events, traces and UIs live.
"""
