"""Float32 master weights of the owned low-precision parameters (``bf16-true``, ``16-true``).

Engine logic with no Lightning in it: the strategies create one :class:`MasterWeights` per
wrapper when the precision keeps half-precision parameters, put the masters in every
optimizer, and write them back after each step.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class MasterWeights:
    """Float32 master copies of the owned low-precision parameters (``bf16-true``, ``16-true``).

    With a half-precision model, stepping the half-precision parameters
    directly loses small updates to rounding. Each rank keeps a float32 copy of
    the parameters it *owns* only (1/world of the model), puts those copies in
    the optimizer in place of the half-precision ones, and after each step
    writes them back into the param buffer, from where the all-gather spreads
    them. The copies' gradients are views of the float32 gradient buffer
    (the strategy reduces half-precision gradients in float32), so clipping and
    the optimizer see the same tensors.
    """

    def __init__(self, wrapper, rename: Callable[[str], str] = lambda name: name) -> None:
        self.wrapper = wrapper
        self.rename = rename
        """Parameter name -> checkpoint name (identity but for experts)."""
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self.master_of: dict[torch.Tensor, torch.nn.Parameter] = {}
        """The master the optimizers hold in place of each owned low-precision parameter or piece."""
        self.names: dict[torch.Tensor, str] = {}
        for name, p in wrapper.named_owned_parameters():
            if p.dtype in (torch.bfloat16, torch.float16):
                master = torch.nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
                self.master_of[p] = master
                self.pairs.append((p, master))
                self.names[master] = name
                wrapper.set_master(p, master)  # the wrapper hands it the float32 gradient at each sync

    def use_in(self, optimizer: torch.optim.Optimizer) -> None:
        """Puts the masters in ``optimizer`` in place of their parameters; state created before follows."""
        swap = self.master_of
        for group in optimizer.param_groups:
            group["params"] = [swap.get(p, p) for p in group["params"]]
        for p, master in swap.items():
            if p in optimizer.state:
                optimizer.state[master] = optimizer.state.pop(p)

    @property
    def numel(self) -> int:
        return sum(m.numel() for _, m in self.pairs)

    @torch.no_grad()
    def write_back(self) -> None:
        """Copies the masters into the model's (half-precision) parameters, i.e. the param buffer."""
        for p, master in self.pairs:
            p.copy_(master)

    @torch.no_grad()
    def refresh(self) -> None:
        """Sets the masters to the (just loaded) parameters; a checkpoint's masters then override them."""
        for p, master in self.pairs:
            master.copy_(p)

    def checkpoint_name(self, master: torch.Tensor) -> str:
        """The name a checkpoint keys ``master`` by (a global expert name, Note [expert checkpoints] in
        ``checkpoint/ownership.py``)."""
        return self.rename(self.names[master])

    def state_dict(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, torch.Tensor]:
        """This rank's masters by checkpoint name (on CPU); those ``optimizer`` holds, if given."""
        held = None if optimizer is None else {id(t) for g in optimizer.param_groups for t in g["params"]}
        return {self.checkpoint_name(m): m.detach().cpu() for _, m in self.pairs if held is None or id(m) in held}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores the owned masters from a full ``{name: tensor}`` mapping and writes them back."""
        for p, master in self.pairs:
            name, key = self.names[master], self.checkpoint_name(master)
            if key in state:
                value = state[key]
                if value.numel() != master.numel():  # a full master; this rank steps a piece of it
                    slot = self.wrapper.layout.params[name]
                    value = self.wrapper.records.of(p).unit.piece.cut(value, slot.shape)
                master.copy_(value.reshape(master.shape))
        self.write_back()
