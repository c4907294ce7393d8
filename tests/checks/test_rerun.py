"""The reruns' own parts in process, on a one-rank gloo world: a backward trace through a module output the loss
never reads (a last block's text stream) behind a tensor-parallel plan."""

import pytest
import torch

from paracheck.checks import localize, rerun, unread


@pytest.fixture
def mesh(tp_mesh_of_one):
    return tp_mesh_of_one


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.img, self.up, self.down = torch.nn.Linear(4, 4), torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x, text):
        return self.img(x), self.down(self.up(text))


class Model(torch.nn.Module):
    """One joint block whose text stream nothing reads after it (qwenimage's last block)."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x, text):
        return self.block(x, text)[0]


def test_a_stream_the_loss_never_reads_is_read_as_an_exact_zero_and_the_trace_runs(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Model()
    parallelize_module(model.block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x, text = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)

    def plain(m):
        return m(x, text).pow(2).sum()

    # torch's own behaviour, which the rerun works around: the hook's zero for the unread output breaks DTensor.
    with pytest.raises(AttributeError, match="_local_tensor"):
        rerun.record_backward(model, plain, local=localize.local_share)
    unused = unread.unused_outputs(model, plain)
    assert unused == {"block": [1], "block.up": [0], "block.down": [0]}

    def loss(m):
        with unread.returned(m, unused) as held:
            value = plain(m)
        return unread.read_by(value, held)

    assert torch.equal(loss(model), plain(model))
    calls = rerun.record_backward(model, loss, local=localize.local_share)
    assert [c.key for c in calls] == ["block.down", "block.up", "block.img", "block", "<root>"]
    assert all(p.grad is None for p in model.parameters())  # the reruns leave the gradients as they were
    assert all(m._compiled_call_impl is None for m in model.modules())


def test_the_reruns_leave_every_gradient_as_the_checks_saw_it():
    torch.manual_seed(0)
    model = Model()
    x, text = torch.randn(2, 4), torch.randn(2, 4)
    model(x, text).sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def plain(m):
        return m(x, text).pow(2).sum()

    unread.unused_outputs(model, plain)
    rerun.record_backward(model, plain)
    assert {n: p.grad for n, p in model.named_parameters() if p.grad is not None}.keys() == before.keys()
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters() if n in before)
