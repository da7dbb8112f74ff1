"""MindSpore as its documentation writes a training step: the network and loss in ``nn.WithLossCell``,
``nn.TrainOneStepCell(net_with_loss, optimizer)`` (whose construct computes the gradients, averages
them over data-parallel ranks with its ``DistributedGradReducer`` and applies the optimizer), here
subclassed to clip by global norm before the update, and ``nn.AdamWeightDecay`` with decay on 2-D
weights (a parameter group without it); graph mode; data parallel over msrun with
``set_auto_parallel_context(parallel_mode=DATA_PARALLEL, gradients_mean=True)``.

Recipe (docs/sources.md#documented-training-loops): mindspore.nn.TrainOneStepCell (https://www.mindspore.cn/docs/en/r2.10.0/api_python/nn/mindspore.nn.TrainOneStepCell.html,
whose construct this subclass repeats with one ``ops.clip_by_global_norm`` added), mindspore.nn.AdamWeightDecay
(its group-parameter example) and the data-parallel tutorial
(https://www.mindspore.cn/tutorials/en/r2.10.0/parallel/data_parallel.html). The network is parabench's
MindSpore Llama cell, the one the mindspore adapter trains (MindSpore has no Llama class of its own).
AdamWeightDecay applies no bias correction (the adapter folds torch's into the same fused primitive's
inputs): the same kernel per parameter either way.

    python mindspore_native.py OUT OVERRIDES_JSON                       (1 rank)
    msrun --worker_num=2 --local_worker_num=2 --master_port=P --join=True python mindspore_native.py OUT OVERRIDES_JSON
"""

import time

from native_common import batches, load_job, threads, write_times


def main() -> None:
    import mindspore as ms
    import numpy as np
    from mindspore import nn, ops

    out, job = load_job()
    opts = job.backend.options
    ms.set_context(mode=ms.GRAPH_MODE if opts.mode == "graph" else ms.PYNATIVE_MODE)
    if opts.mode == "graph":
        ms.set_context(jit_config={"jit_level": opts.jit_level})
    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(threads(job))
    rank, world = 0, 1
    if job.launch.world_size > 1:
        from mindspore.communication import get_group_size, get_rank, init

        init()  # under msrun; its scheduler process never returns from here
        rank, world = get_rank(), get_group_size()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)

    from parabench.adapters import mindspore_cells as cells
    from parabench.model import initial_weights

    class Loss(nn.Cell):
        def construct(self, logits, targets):
            return cells.causal_lm_loss(logits, targets)

    class TrainOneStepClipped(nn.TrainOneStepCell):
        def __init__(self, network, optimizer, max_norm: float):
            super().__init__(network, optimizer)
            self.max_norm = max_norm

        def construct(self, *inputs):
            loss = self.network(*inputs)
            sens = ops.fill(loss.dtype, loss.shape, self.sens)
            grads = self.grad(self.network, self.weights)(*inputs, sens)
            grads = self.grad_reducer(grads)
            grads = ops.clip_by_global_norm(grads, self.max_norm)
            return ops.depend(loss, self.optimizer(grads))

    net = cells.Llama(job.model, initial_weights(job.model, job.run.seed), job.data.seq_len)
    params, spec = net.trainable_params(), job.optim
    optimizer = nn.AdamWeightDecay(
        [
            {"params": [p for p in params if len(p.shape) >= 2], "weight_decay": spec.weight_decay},
            {"params": [p for p in params if len(p.shape) < 2], "weight_decay": 0.0},
        ],
        learning_rate=spec.lr,
        beta1=spec.betas[0],
        beta2=spec.betas[1],
        eps=spec.eps,
    )
    train_net = TrainOneStepClipped(nn.WithLossCell(net, Loss()), optimizer, spec.grad_clip)
    if world > 1 and not train_net.reducer_flag:
        raise RuntimeError("TrainOneStepCell built no gradient reducer: the ranks would not average gradients")
    batch, times, first_loss = batches(job, rank, world), [], None
    for step in range(job.run.warmup_steps + job.run.steps):
        inputs, targets = (ms.Tensor(a.astype(np.int32)) for a in batch(step))
        t0 = time.perf_counter()
        loss = train_net(inputs, targets).asnumpy()  # the loss depends on the update: this waits for it
        if step >= job.run.warmup_steps:
            times.append(time.perf_counter() - t0)
        if step == 0:
            first_loss = float(loss)
    write_times(out, rank, job, times, first_loss)


if __name__ == "__main__":
    main()
