"""A search's simulations on a Ray cluster instead of this machine's process pool: for searches too large for one
host (many models x fleets x seeds). Ray is an optional extra (`pip install -e '.[ray]'`).

`ray_executor("local")` starts a Ray instance on this machine, bound to 127.0.0.1 with no dashboard;
`ray_executor("ray://host:10001")` or `"host:6379"` joins an existing cluster, whose workers must have this
package installed. The executor is a concurrent.futures Executor whose `submit` runs each candidate as a Ray task,
so the search (and its results) are the same as with the local pool.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from plan.errors import PlanError


class RayExecutor(Executor):
    """Each submitted call runs as a Ray task; its future is the task's."""

    def __init__(self, ray: Any, started: bool) -> None:
        self._ray, self._started = ray, started
        self._remote: dict[Callable[..., Any], Any] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        remote = self._remote.setdefault(fn, self._ray.remote(fn))
        return remote.remote(*args, **kwargs).future()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._started:
            self._ray.shutdown()


def ray_executor(address: str, workers: int | None = None) -> RayExecutor:
    """A RayExecutor on a local Ray instance (`address` "local") or the cluster at `address`."""
    try:
        import ray
    except ImportError:
        raise PlanError("--ray: Ray is not installed; install the extra with pip install -e '.[ray]'") from None
    if ray.is_initialized():
        return RayExecutor(ray, started=False)
    if address == "local":
        ray.init(num_cpus=workers, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    else:
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise PlanError(f"--ray {address}: cannot join that Ray cluster ({exc}); check the address") from None
    return RayExecutor(ray, started=True)
