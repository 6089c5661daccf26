"""`offload:`: where the optimizer state, the parameters and their gradient rest between steps
(docs/offload.md), and the rules that combine them with the rest of the run, in one place."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config.base import _choice
from meshrun.errors import ConfigError

OFFLOAD_TIERS = ("none", "host", "nvme")  # offload.optimizer
OFFLOAD_UPDATES = ("auto", "streamed", "whole")  # offload.update
OFFLOAD_UPDATE_ON = ("auto", "device", "host")  # offload.update_on
OFFLOAD_GRADS = ("host", "nvme")  # offload.grads


@dataclass(frozen=True)
class OffloadConfig:
    # Where the optimizer state (moments, and the float32 master weights of params stored below
    # float32) rests between steps: none (device) | host (host memory) | nvme (files in `dir`); host and
    # nvme stream the update through the device in chunks of budget_mb. true/false read as host/none.
    optimizer: str | bool = "none"
    dir: str = ""  # nvme: a local directory per process ("{process}" is replaced by its index)
    budget_mb: float = 256.0  # nvme, host: host memory for the streamed update's chunk buffers
    # host tier's update: streamed (chunk by chunk, as nvme's; the device holds a few chunks of state) |
    # whole (the whole shard to the device inside the step) | auto (streamed when the optimizer allows)
    update: str = "auto"
    # where the streamed update's chunks are computed: device (copied to the devices and back) | host
    # (jax's CPU backend: the gradient comes down, the new params go up) | auto (in place on CPU
    # devices, whose memory is host memory; device on others)
    update_on: str = "auto"
    # ZeRO-3 parameters rest in pinned host memory; each layer comes to the device (and is gathered)
    # inside the layer scan, and its reduced gradient goes back to host memory as the backward makes it
    params: bool = False
    # with params and optimizer=nvme: where the layers' float32 gradient rests between the backward and
    # the update: host (pinned host memory) | nvme (written to the tier's file layer by layer as the
    # backward makes it; one microbatch, no pipeline)
    grads: str = "host"

    def __post_init__(self):
        if isinstance(self.optimizer, bool):  # the older boolean spelling
            object.__setattr__(self, "optimizer", "host" if self.optimizer else "none")
        _choice("offload.optimizer", self.optimizer, OFFLOAD_TIERS)
        _choice("offload.update", self.update, OFFLOAD_UPDATES)
        if self.update != "auto" and self.optimizer != "host":
            raise ConfigError("offload.update", self.update, "leave it auto, or set offload.optimizer=host",
                              "chooses the host tier's update only")  # fmt: skip
        if self.update == "streamed" and self.params:
            raise ConfigError("offload.update", "streamed", "leave it auto with offload.params",
                              "offload.params streams the update layer by layer itself")  # fmt: skip
        _choice("offload.update_on", self.update_on, OFFLOAD_UPDATE_ON)
        if self.update_on != "auto":
            why = ("there is no optimizer tier (offload.optimizer=none)" if self.optimizer == "none" else
                   "offload.update=whole updates the whole shard on the device" if self.update == "whole"
                   else "offload.params streams the update layer by layer on the device" if self.params
                   else None)  # fmt: skip
            if why is not None:
                raise ConfigError("offload.update_on", self.update_on, "leave it auto, or use it with "
                                  "the streamed update (offload.optimizer=host or nvme)", why)  # fmt: skip
        if not 0 < self.budget_mb <= 2**30:
            raise ConfigError("offload.budget_mb", self.budget_mb, "use a positive size in MiB, e.g. 256")
        if self.params not in (True, False):
            raise ConfigError("offload.params", self.params, "use true or false")
        _choice("offload.grads", self.grads, OFFLOAD_GRADS)
        if self.grads != "host" and not self.params:
            raise ConfigError("offload.grads", self.grads, "set offload.params=true with it (or leave it host)",
                              "moves the gradient of the parameters offload.params streams")  # fmt: skip
        if self.optimizer == "nvme" and not self.dir:
            raise ConfigError(
                "offload.dir", self.dir, "give a local directory for the optimizer state files, "
                "e.g. offload.dir=/local/nvme/offload", "required with offload.optimizer=nvme",
            )  # fmt: skip

    def check_run(self, zero: int) -> None:
        """The rules across sections that need only the train section (RunConfig asks)."""
        if self.params and (refused := offload_params_refusals(zero, self.optimizer, offload_grads=self.grads)):
            raise ConfigError("offload.params", True, refused[0][1], refused[0][0])


def offload_params_refusals(
    zero: int,
    offload_optimizer: str,
    *,
    fp8: str | None = None,
    pipe: int | None = None,
    offload_grads: str = "host",
    microbatches: int | None = None,
    overlap_grad_reduce: bool = False,
) -> list[tuple[str, str]]:
    """Why meshrun refuses `offload.params=true` beside these settings: (what, fix) pairs, empty
    when it runs them. The one place these rules live: TrainConfig, the step's plan (the model's
    fields, the mesh's pipeline degree) and the planner (which proposes only what this accepts) ask
    it. A field given as None is not checked (TrainConfig does not see the model's). Params below
    float32 run with or without a pipeline: their float32 gradient goes to float32 arrays beside them
    (`layer_fetch.Shadowed`), which the microbatch scan or the stage's vjp differentiates."""
    out = _nvme_grads_refusals(offload_optimizer, pipe, microbatches) if offload_grads == "nvme" else []
    if overlap_grad_reduce:
        out.append(("reduces each layer's gradients inside the layer loop already (pipeline.overlap_grad_reduce=true)",
                    "set pipeline.overlap_grad_reduce=false with it"))  # fmt: skip
    if zero != 3:
        out.append((f"needs ZeRO-3's sharded parameters (train.zero={zero})", "set train.zero=3 (or turn it off)"))
    if fp8 not in (None, "none") and offload_grads == "nvme":
        out.append(("with offload.grads=nvme sends the fp8 scaling observations to the gradient file, "
                    "where the update does not read them", "use offload.grads=host with model.fp8"))  # fmt: skip
    return out


def _nvme_grads_refusals(offload_optimizer: str, pipe: int | None, microbatches: int | None) -> list[tuple[str, str]]:
    """`offload_params_refusals`' (what, fix) pairs for `offload.grads=nvme`. The gradient goes to the
    nvme tier's file as the backward makes it and the streamed update reads it there once: the tier's
    file and its update must exist, and with several microbatches every layer's sum would be read,
    added to and written back on NVMe m times a step. None (`pipe`, `microbatches`): not checked."""
    out = []
    if offload_optimizer != "nvme":
        out.append((f"with offload.grads=nvme needs the nvme tier (offload.optimizer={offload_optimizer})",
                    "set offload.optimizer=nvme with it"))  # fmt: skip
    if microbatches is not None and microbatches > 1:
        out.append((f"with offload.grads=nvme writes each layer's gradient once a step, so it takes one "
                    f"microbatch (pipeline.microbatches={microbatches})",
                    "set pipeline.microbatches=1 (a larger micro-batch instead) or offload.grads=host"))  # fmt: skip
    if pipe is not None and pipe > 1:
        out.append((f"with offload.grads=nvme is built without a pipeline only (mesh.pipe={pipe})",
                    "use mesh.pipe=1 or offload.grads=host with it"))  # fmt: skip
    return out


def fp8_tier_refusal(fp8: str, tier: str) -> str | None:
    """Why optimizer tier `tier` cannot carry fp8 recipe `fp8` (None: it can). The nvme tier's update
    is the optimizer's elementwise pass over the state's chunks; delayed scaling's amax history is
    updated by the step outside that pass, so it would go stale and the run would silently differ.
    The one rule: the run's config and the planner (`planner.tiers`) ask it."""
    if tier == "nvme" and fp8 == "delayed":
        return "the nvme tier's update does not carry delayed scaling's amax history"
    return None


def streamed_update_refusal(optimizer: str, elementwise: bool, state_dtype: str, fp8: str | None = None) -> str | None:
    """Why the host tier cannot stream this optimizer's update chunk by chunk (None: it can), so that
    `offload.update=auto` keeps the whole-shard update and `streamed` is refused. The one place
    the rule lives: the step's plan (`offload.registry.placement`) and the planner (`planner.tiers`)."""
    if not elementwise:
        return f"{optimizer}'s update is not elementwise"
    if state_dtype != "float32":
        return f"the streamed update keeps float32 state (optimizer.state_dtype={state_dtype})"
    if fp8 not in (None, "none"):
        return "the streamed update does not carry fp8 scaling state"
    return None


def streams_host_update(offload_update: str, offload_params: bool, refusal: str | None) -> bool:
    """Whether the host tier's update streams chunk by chunk: not with offload.update=whole, nor
    offload.params (which streams layer by layer itself), nor where `streamed_update_refusal`
    objects (auto keeps the whole-shard update there). The one rule the step's plan
    (`offload.registry.placement`) and the planner (`planner.tiers.host_streams`) ask."""
    return offload_update != "whole" and not offload_params and refusal is None
