"""The client and server optimizers: explicit state, pure update functions on float32 vectors.

Each optimizer is ``init(d) -> state`` and ``update(state, g, ...) -> (step, state)`` in the style
of optax: ``state`` is a dict of arrays (numpy from ``init``, what a checkpoint stores), the caller
applies ``w <- w - step``. Every operation is float32, elementwise, in a fixed order, so the same
inputs give the same bits on every rank and after ``--resume``. Both sides' formulas are written
once for numpy arrays and, off the CPU, torch tensors on the device (the clients' rows, the
server's weights and state; :class:`fedring.train.device.Staging`,
:class:`fedring.train.replica.Replica`): the same operations in the same order, each a correctly
rounded float32 multiplication, addition, division or square root, so only clipping's float64
norm is summed in another order. ``docs/training.md`` explains the
choices (why the client uploads its momentum vector, what a server optimizer does to the sign
rules' output).

The client side (:class:`ClientOptimizer`), per client ``i`` and round ``t``, on every local
mini-batch gradient ``g`` (before the local SGD step, PyTorch's order)::

    g <- g * min(1, c / ||g||_2)        clip_norm = c           (per client, per mini-batch)
    g <- g + lambda * w                 weight_decay = lambda   (coupled, as torch.optim.SGD)

and once per round on the client's update direction ``u`` (the gradient with one local step, the
pseudo-gradient ``(w - w_local) / lr`` with more)::

    m_i <- beta * m_i + u               momentum = beta        (heavy ball, m_i = 0 at round 0)
    m_i <- beta * m_i + (1 - beta) * u  with dampening = true  (ByzFL's clients and the papers' form)
    upload m_i, or u + beta * m_i       nesterov = false / true

The server side (:data:`SERVER_OPTIMIZERS`) on the robust aggregate ``g`` of round ``t``, with the
step size ``eta_t`` (its section's ``lr`` times the schedule's factor; default the run's ``lr_t``):
Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2, with ``Delta_t = -g``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fedring.arrays import array_namespace
from fedring.errors import ConfigError
from fedring.registry import Registry
from fedring.validate import choice, real

if TYPE_CHECKING:  # torch itself only where a tensor is made: a run's settings are checked without it
    import torch

F32 = np.float32
#: a float32 vector or rows: a numpy array on the host path, a torch tensor on the device path
#: (:class:`fedring.train.device.Staging`); Any, as the run picks the kind, not the code
Vector = Any
#: a server optimizer's state: numpy arrays from ``init`` and in a checkpoint, of the weights' kind in a run
State = dict[str, Vector]
ClientState = dict[str, Vector]


def f32(x: float) -> float:
    """``x`` rounded to float32, as a Python float: numpy (NEP 50) and torch alike multiply a float32
    vector by it in float32, where torch takes no numpy scalar.

    >>> f32(0.1)
    0.10000000149011612
    """
    return float(F32(x))


# ---------------------------------------------------------------------------------------------
# Client optimizer


def clip(g: Vector, c: float) -> Vector:
    """``g * min(1, c / ||g||)`` in place, the norm summed in float64 (numpy's sum for an array,
    torch's, in another order, for a tensor) and the factor ``c / ||g||`` rounded to float32; a zero
    vector stays zero. Rows ``(n, d)``: each row on its own. A tensor's factors are chosen on its
    device (1, an exact product, inside the ball and for a NaN norm), every row's at once, so that
    no read of a norm waits for the device.

    >>> clip(np.array([3, 4], np.float32), 1.0).tolist()
    [0.6000000238418579, 0.800000011920929]
    >>> clip(np.array([0.3, 0.4], np.float32), 1.0).tolist()  # inside the ball: unchanged
    [0.30000001192092896, 0.4000000059604645]
    >>> import torch
    >>> clip(torch.tensor([3.0, 4.0]), 1.0).tolist()
    [0.6000000238418579, 0.800000011920929]
    """
    if isinstance(g, np.ndarray):
        for row in g if g.ndim == 2 else [g]:
            length = float(np.linalg.norm(row.astype(np.float64)))
            if length > c:
                row *= f32(c / length)
        return g
    import torch

    if g.ndim == 1 or len(g) == 1:
        norm = torch.linalg.vector_norm(g, dim=-1, keepdim=True, dtype=torch.float64)
    else:  # a reduction per row: one over the rows' last axis in float64 is several times slower on a CPU
        norm = torch.stack([torch.linalg.vector_norm(row, dtype=torch.float64) for row in g])[:, None]
    # a division of two tensors, correctly rounded as the host's (a scalar's multiplies by a reciprocal)
    factor = torch.full_like(norm, c).div_(norm).clamp_(max=1.0).nan_to_num_(nan=1.0)
    g *= factor.to(torch.float32)
    return g


class ClientOptimizer:
    """Per-client gradient clipping, weight decay and heavy-ball (or Nesterov) momentum.

    ``momentum = beta`` keeps one buffer ``m_i`` per client (``state["m"]``, a row per local
    client: O(local clients x d) per rank, in host memory or on the device); without momentum the
    state is empty. Vectors and rows are all numpy arrays or all tensors on one device.

    >>> opt = ClientOptimizer(momentum=0.5)
    >>> m = opt.init(2, 2)
    >>> opt.direction(m, 0, np.array([1, 2], np.float32)).tolist()   # m = u
    [1.0, 2.0]
    >>> opt.direction(m, 0, np.array([1, 0], np.float32)).tolist()   # m = 0.5 m + u
    [1.5, 1.0]
    >>> ClientOptimizer(momentum=0.5, nesterov=True).direction(m, 0, np.array([1, 0], np.float32)).tolist()  # m = [1.75, 0.5]; u + 0.5 m
    [1.875, 0.25]
    >>> d = ClientOptimizer(momentum=0.5, dampening=True)   # m = beta m + (1 - beta) u (ByzFL, the papers)
    >>> md = d.init(1, 2)
    >>> d.direction(md, 0, np.array([1, 2], np.float32)).tolist(), d.direction(md, 0, np.array([1, 0], np.float32)).tolist()
    ([0.5, 1.0], [0.75, 0.5])
    >>> ClientOptimizer(weight_decay=0.1).gradient(np.array([1, 1], np.float32), np.array([2, -4], np.float32)).tolist()
    [1.2000000476837158, 0.6000000238418579]
    """

    def __init__(
        self,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        clip_norm: float | None = None,
        dampening: bool = False,
    ):
        self.momentum = real("momentum", momentum, lo=0, hi=1, hi_open=True)
        self.nesterov, self.dampening = bool(nesterov), bool(dampening)
        for key, on in (("nesterov", self.nesterov), ("dampening", self.dampening)):
            if on and self.momentum == 0:
                raise ConfigError(key, f"{key} needs momentum > 0 (e.g. --set momentum=0.9)")
        self.weight_decay = real("weight_decay", weight_decay, lo=0)
        self.clip_norm = None if clip_norm is None else real("clip_norm", clip_norm, lo=0, lo_open=True)

    @property
    def transforms_gradient(self) -> bool:
        return self.weight_decay != 0 or self.clip_norm is not None

    def init(self, n_local: int, d: int, device: torch.device | None = None) -> ClientState:
        """The rows of ``n_local`` clients: numpy arrays, or tensors on ``device``."""
        if not self.momentum:
            return {}
        if device is None:
            return {"m": np.zeros((n_local, d), F32)}
        import torch

        return {"m": torch.zeros((n_local, d), dtype=torch.float32, device=device)}

    def gradient(self, g: Vector, w: Vector) -> Vector:
        """One mini-batch gradient ``g`` at the local weights ``w``: clipped, then weight decay (in
        place); or ``(clients, d)`` rows of them, each clipped on its own, at the rows ``w`` (one row
        for all, or one each)."""
        if self.clip_norm is not None:
            clip(g, self.clip_norm)
        if self.weight_decay:
            g += f32(self.weight_decay) * w
        return g

    def direction(self, state: ClientState, k: int | slice, u: Vector) -> Vector:
        """The vector local client ``k`` uploads for its update direction ``u``; updates its buffer ``m_k``
        (in place, as ``u``). With a slice ``k`` of local clients, ``u`` is their rows."""
        if not self.momentum:
            return u
        m, beta = state["m"][k], f32(self.momentum)
        m *= beta
        if self.dampening:
            m += f32(1 - self.momentum) * u
        else:
            m += u
        if self.nesterov:
            u += beta * m
        else:
            u[:] = m
        return u


def sqrt32(v: Vector) -> Vector:
    """The float32 square root of ``v``, correctly rounded (as IEEE 754 asks): numpy's for an array; for
    a tensor, the root in float64 rounded to float32, as torch's float32 kernel is not correctly rounded
    on every CPU (its AVX-512 one misses on about 17% of entries). Rounding twice gives the correctly
    rounded root: float64's 53 bits are at least 2 x 24 + 2 (Figueroa, "When is double rounding
    innocuous?", 1995).

    >>> import torch
    >>> v = np.float32([2, 1e-4, 3e38, 0])
    >>> sqrt32(torch.from_numpy(v)).numpy().tobytes() == np.sqrt(v).tobytes()
    True
    """
    if isinstance(v, np.ndarray):
        return np.sqrt(v)
    xp = array_namespace(v)
    return xp.astype(xp.sqrt(xp.astype(v, xp.float64)), xp.float32)


# ---------------------------------------------------------------------------------------------
# Server optimizers: Reddi et al. (2021), Algorithm 2. fedring's aggregate g is a descent
# direction (a gradient, or (w - w_local)/lr), so the paper's Delta_t is -g and its
# x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau) is w <- w - eta m_t / (sqrt(v_t) + tau) with m_t built from g.

#: the server optimizers (setting ``server_optimizer``; parameters in the section named after it)
SERVER_OPTIMIZERS = Registry("server_optimizer")


@SERVER_OPTIMIZERS.register
class ServerSGD:
    """``w <- w - eta_t g``: today's update (FedAvg's server step with the run's ``lr``).

    ``update`` takes ``g`` and the state of one kind, numpy arrays or tensors on one device, and
    returns the step of that kind (``on_device``): every server optimizer here is written through the
    array's namespace, with float32 scalars (:func:`f32`). A subclass declares ``on_device = True``
    itself; one that does not (an optimizer of a plugin, written for numpy) gets numpy arrays on the
    device path too (:class:`fedring.train.replica.Replica`).

    >>> s = ServerSGD()
    >>> s.update(s.init(2), np.array([1, -2], np.float32), 0.5)[0].tolist()
    [0.5, -1.0]
    >>> import torch
    >>> s.update(s.init(2), torch.tensor([1.0, -2.0]), 0.5)[0].tolist()
    [0.5, -1.0]
    """

    name = "sgd"
    on_device: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.on_device = cls.__dict__.get("on_device", False)  # not inherited: the subclass's update may be numpy's

    def __init__(self, lr: float | None = None):
        self.lr = None if lr is None else real(f"{self.name}.lr", lr, lo=0, lo_open=True)

    def eta(self, run_lr: float, factor: float) -> float:
        """The server step size of a round: the section's ``lr`` times the schedule's factor, else the run's."""
        return run_lr * factor if self.lr is None else self.lr * factor

    def init(self, d: int) -> State:
        return {}

    def update(self, state: State, g: Vector, eta: float, t: int = 0) -> tuple[Vector, State]:
        """The step ``w <- w - step`` of round ``t`` for the aggregate ``g`` with step size ``eta``."""
        return f32(eta) * g, state


@SERVER_OPTIMIZERS.register
class ServerMomentum(ServerSGD):
    """Server momentum (FedAvgM; Hsu et al. 2019): ``m_t = beta m_{t-1} + g``, ``w <- w - eta_t m_t``, m_{-1} = 0.

    >>> s = ServerMomentum(beta=0.5)
    >>> st = s.init(1)
    >>> [s.update(st, np.array([1], np.float32), 1.0)[0].item() for _ in range(3)]
    [1.0, 1.5, 1.75]
    """

    name = "momentum"
    on_device = True

    def __init__(self, lr: float | None = None, beta: float = 0.9):
        super().__init__(lr)
        self.beta = real("momentum.beta", beta, lo=0, hi=1, hi_open=True)

    def init(self, d: int) -> State:
        return {"m": np.zeros(d, F32)}

    def update(self, state: State, g: Vector, eta: float, t: int = 0) -> tuple[Vector, State]:
        m = state["m"]
        m *= f32(self.beta)
        m += g
        return f32(eta) * m, state


class _Adaptive(ServerSGD):
    """Algorithm 2's common part: ``m_t = beta1 m_{t-1} + (1 - beta1) Delta_t`` and
    ``x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)``, from m_{-1} = 0 and v_{-1} = tau^2
    (the algorithm asks v_{-1} >= tau^2). No bias correction: the algorithm has none.

    ``variant = "flower"`` is Flower's ``FedAdam``, ``FedYogi`` and ``FedAdagrad`` (``flwr``'s
    ``server/strategy`` and ``serverapp/strategy``): v_{-1} = 0, and FedAdam's step size bias-corrected
    as ``eta sqrt(1 - beta2^(r+1)) / (1 - beta1^(r+1))`` with Flower's 1-based round r = t + 1. Units:
    fedring's ``g`` is a gradient, Flower's Delta a change of the weights (``-lr_client g``), so
    Flower's ``tau`` is fedring's times the client's learning rate: set ``tau = tau_flower / lr``
    (exact with a constant lr). ``docs/training.md`` compares the two.
    """

    def __init__(self, lr: float | None = None, beta1: float = 0.9, tau: float = 1e-3, variant: str = "reddi"):
        super().__init__(lr)
        self.beta1 = real(f"{self.name}.beta1", beta1, lo=0, hi=1, hi_open=True)
        self.tau = real(f"{self.name}.tau", tau, lo=0, lo_open=True)
        self.variant = choice(f"{self.name}.variant", variant, ("reddi", "flower"))

    def init(self, d: int) -> State:
        v0 = F32(self.tau) ** 2 if self.variant == "reddi" else F32(0)
        return {"m": np.zeros(d, F32), "v": np.full(d, v0, F32)}

    def step_size(self, eta: float, t: int) -> float:
        """The step size of round ``t`` (Flower's FedAdam corrects it; the others leave it)."""
        return eta

    def second_moment(self, v: Vector, g2: Vector) -> None:
        """``v_{t-1} -> v_t`` in place, from ``Delta_t^2 = g^2``."""
        raise NotImplementedError

    def update(self, state: State, g: Vector, eta: float, t: int = 0) -> tuple[Vector, State]:
        m, v = state["m"], state["v"]
        m *= f32(self.beta1)
        m += f32(1 - self.beta1) * g
        self.second_moment(v, g * g)
        return f32(self.step_size(eta, t)) * m / (sqrt32(v) + f32(self.tau)), state


@SERVER_OPTIMIZERS.register
class ServerAdagrad(_Adaptive):
    """FedAdagrad: ``v_t = v_{t-1} + Delta_t^2`` (Algorithm 2).

    >>> s = ServerAdagrad(beta1=0.5, tau=1.0)
    >>> state = s.init(1)                       # m = 0, v = tau^2 = 1
    >>> s.update(state, np.array([3], np.float32), 1.0)[0].item()    # m = 1.5, v = 1 + 9, step = 1.5 / (sqrt(10) + 1)
    0.3603796064853668
    >>> s.update(state, np.array([-6], np.float32), 1.0)[0].item()   # m = 0.75 - 3, v = 10 + 36, step = -2.25 / (sqrt(46) + 1)
    -0.2891165018081665
    """

    name = "adagrad"
    on_device = True

    def second_moment(self, v: Vector, g2: Vector) -> None:
        v += g2


class _Beta2(_Adaptive):
    def __init__(
        self,
        lr: float | None = None,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        variant: str = "reddi",
    ):
        super().__init__(lr, beta1, tau, variant)
        self.beta2 = real(f"{self.name}.beta2", beta2, lo=0, hi=1, hi_open=True)


@SERVER_OPTIMIZERS.register
class ServerAdam(_Beta2):
    """FedAdam: ``v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2`` (Algorithm 2).

    >>> s = ServerAdam(beta1=0.5, beta2=0.5, tau=1.0)
    >>> s.update(s.init(1), np.array([7], np.float32), 2.0)[0].item()   # m = 3.5, v = 0.5 + 24.5, 2 * 3.5 / (5 + 1)
    1.1666666269302368
    """

    name = "adam"
    on_device = True

    def step_size(self, eta: float, t: int) -> float:
        """Flower's bias correction, ``eta sqrt(1 - beta2^(t+2)) / (1 - beta1^(t+2))``; Reddi et al. have none.

        >>> ServerAdam(beta1=0.5, beta2=0.75, variant="flower").step_size(1.0, 0)   # sqrt(1 - 9/16) / (1 - 1/4)
        0.8819171036881969
        """
        if self.variant == "reddi":
            return eta
        return eta * math.sqrt(1 - self.beta2 ** (t + 2)) / (1 - self.beta1 ** (t + 2))

    def second_moment(self, v: Vector, g2: Vector) -> None:
        v *= f32(self.beta2)
        v += f32(1 - self.beta2) * g2


@SERVER_OPTIMIZERS.register
class ServerYogi(_Beta2):
    """FedYogi: ``v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)`` (Algorithm 2).

    >>> s = ServerYogi(beta1=0.5, beta2=0.5, tau=1.0)
    >>> # m = 3.5, v = 1 - 0.5 * 49 * sign(1 - 49) = 25.5, step 2 * 3.5 / (sqrt(25.5) + 1)
    >>> s.update(s.init(1), np.array([7], np.float32), 2.0)[0].item()
    1.1570721864700317
    """

    name = "yogi"
    on_device = True

    def second_moment(self, v: Vector, g2: Vector) -> None:
        # the namespace's sign: torch's own gives 0 for NaN, numpy's (and the namespace's) NaN
        v -= f32(1 - self.beta2) * g2 * array_namespace(v).sign(v - g2)


def make_server_optimizer(name: str, params: dict | None = None) -> ServerSGD:
    """Server optimizer ``name`` from its settings section; unknown names or keys raise ConfigError."""
    return SERVER_OPTIMIZERS.build(name, params, key="server_optimizer")
