"""The unbiased pass@k estimator, vectorized and computed in log space.

pass@k = 1 - C(n - c, k) / C(n, k) for n samples of which c are correct (Chen et al. 2021). The ratio is written as
prod_{i=0}^{k-1} (1 - c / (n - i)) or, equivalently, prod_{j=n-c+1}^{n} (1 - k / j); we take whichever has fewer
factors (min(c, k)), sum their log1p terms and return -expm1(sum). Every step is accurate to a few ulps, so the
result is exact to ~1e-13 relative for n up to 1024 even where pass@k is tiny (c = 1, k = 1) or close to one
(no 1 - (1 - tiny) cancellation, no factorial overflow). It is never a bootstrap: the estimate is unbiased.
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n, c, k):
    """pass@k for integer (arrays of) n samples, c correct, k drawn; broadcasts; a float for scalar inputs.

    Raises ValueError unless 0 <= c <= n and 1 <= k <= n element-wise.
    """
    n_arr, c_arr, k_arr = np.broadcast_arrays(*(np.asarray(x) for x in (n, c, k)))
    for name, arr in (("n", n_arr), ("c", c_arr), ("k", k_arr)):
        if arr.size and not np.issubdtype(arr.dtype, np.integer) and not _integral(arr):
            raise ValueError(f"pass_at_k: {name} must be integers, got {arr}")
    n_arr, c_arr, k_arr = (a.astype(np.int64) for a in (n_arr, c_arr, k_arr))
    if np.any(c_arr < 0) or np.any(c_arr > n_arr):
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n_arr}, c={c_arr}")
    if np.any(k_arr < 1) or np.any(k_arr > n_arr):
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n_arr}, k={k_arr}")

    flat_n, flat_c, flat_k = n_arr.ravel(), c_arr.ravel(), k_arr.ravel()
    out = np.zeros(flat_n.shape, dtype=np.float64)
    certain = flat_n - flat_c < flat_k  # every k-subset holds a correct sample
    out[certain] = 1.0
    todo = np.nonzero(~certain & (flat_c > 0))[0]
    if todo.size:
        n_t, c_t, k_t = flat_n[todo], flat_c[todo], flat_k[todo]
        use_c = c_t <= k_t  # factor over j in (n-c, n] with 1 - k/j, else over i in [0, k) with 1 - c/(n-i)
        terms = np.minimum(c_t, k_t)
        width = int(terms.max())
        idx = np.arange(width, dtype=np.float64)[None, :]
        mask = idx < terms[:, None]
        n_f, c_f, k_f = (x.astype(np.float64)[:, None] for x in (n_t, c_t, k_t))
        numer = np.where(use_c[:, None], k_f, c_f)
        denom = n_f - idx  # both products run over the same denominators n, n-1, ...
        # Masked entries get ratio 0 so log1p never sees -1 (denom may reach 0 there); they add nothing.
        ratio = np.where(mask, numer / np.where(mask, denom, 1.0), 0.0)
        log_ratio = np.where(mask, np.log1p(-ratio), 0.0).sum(axis=1)
        out[todo] = -np.expm1(log_ratio)
    out = out.reshape(n_arr.shape)
    return float(out) if out.ndim == 0 else out


def _integral(arr: np.ndarray) -> bool:
    as_float = np.asarray(arr, dtype=np.float64)
    return bool(np.all(as_float == np.round(as_float)))
