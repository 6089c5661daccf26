"""Least squares in the logs of positive parameters: the one fit behind the planner's calibrations
(`calibrate.fit_calibration`, `calibrate.fit_published`, `cluster_profile.fit_params`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

DX = 1e-4  # the step of the numerical derivatives, in log units


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (tiny systems)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[piv] = m[piv], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    out = [0.0] * n
    for r in reversed(range(n)):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r]
    return out


def fit_logs(
    resid: Callable[[list[float]], list[float]],
    x0: Sequence[float],
    *,
    upper: Sequence[float],
    iters: int,
    max_step: float,
    tol: float,
) -> list[float]:
    """x (logs of the parameters) minimising sum(resid(x)^2) from `x0`: Gauss-Newton, Levenberg-damped
    (1% on the diagonal), numerical derivatives; each step clamped to +-max_step and each x[j] to at most
    upper[j]; at most `iters` steps, stopping when a step moves no x[j] by `tol`."""
    x, n = list(x0), len(x0)
    for _ in range(iters):
        r0 = resid(x)
        cols = []
        for j in range(n):
            xj = list(x)
            xj[j] += DX
            cols.append([(a - b) / DX for a, b in zip(resid(xj), r0)])
        a = [[sum(p * q for p, q in zip(ci, cj)) * (1.01 if i == j else 1.0) + (1e-9 if i == j else 0.0)
              for j, cj in enumerate(cols)] for i, ci in enumerate(cols)]  # fmt: skip
        g = [-sum(c * r for c, r in zip(col, r0)) for col in cols]
        dx = [max(-max_step, min(max_step, d)) for d in solve(a, g)]
        new = [min(xi + di, lim) for xi, di, lim in zip(x, dx, upper)]
        step, x = max(abs(p - q) for p, q in zip(new, x)), new
        if step < tol:
            break
    return x
