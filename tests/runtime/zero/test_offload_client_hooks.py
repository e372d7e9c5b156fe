"""TRL's ZeRO-3 generation dance on zerospeed's engine (calls as in trl/models/utils.py
`remove_hooks` / `add_hooks`): remove the hooks, run the model on gathered parameters, reinstall
them; training afterwards is the same as without the detour, and the detour's output equals the
hooked forward's."""

import torch

from distributed import run_on_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2))


def _trl_remove_hooks(engine) -> None:
    offload = engine.optimizer.parameter_offload
    for _, param in [*offload.module.named_parameters(recurse=True), *offload.module.ds_external_parameters()]:
        param.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks:
        hook.remove()
    for hook in offload.backward_hooks:
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def _trl_add_hooks(engine) -> None:
    offload = engine.optimizer.parameter_offload
    coordinator = offload.param_coordinator
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)


def _train(detour: bool) -> dict:
    import zerospeed

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerospeed.initialize(model=_model(), config=config)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    batches = [(torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(4)]
    losses, outputs = [], []
    for step, (x, y) in enumerate(batches):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if detour and step == 1:
            with torch.no_grad():
                hooked = engine(x)
            _trl_remove_hooks(engine)
            assert engine.optimizer.parameter_offload.forward_hooks == []
            with zerospeed.zero.GatheredParameters(list(engine.module.parameters())), torch.no_grad():
                outputs = [hooked, engine.module(x)]
            _trl_add_hooks(engine)
    return {"losses": losses, "outputs": outputs}


def test_trl_hook_removal_and_reinstall_leave_training_unchanged():
    plain = run_on_ranks(_train, 2, False)
    detoured = run_on_ranks(_train, 2, True)
    for a, b in zip(plain, detoured):
        assert a["losses"] == b["losses"]
        torch.testing.assert_close(b["outputs"][1], b["outputs"][0])
