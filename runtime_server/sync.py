"""Keep the repository in step with the deployments the api records in the artifact store.

The api writes one manifest per deployed version (`deployments/<name>/<version>`, holding the
artifact digest) and asks one runtime server to load it. Every server also reads those
manifests at start and every few seconds, so a restarted server, or a new replica behind a
Kubernetes Service, serves every deployment, and an undeployed one goes away everywhere.
"""

from __future__ import annotations

import logging
import threading

from artifact_store import ManifestNotFound, StoreError
from runtime_server.repository import ModelRepository

log = logging.getLogger("kiln.runtime")
DEPLOYMENTS = "deployments"


def wanted_deployments(store) -> dict[tuple[str, str], str]:
    wanted = {}
    for key in store.list_manifests(DEPLOYMENTS):
        try:
            doc = store.get_manifest(DEPLOYMENTS, key)
        except ManifestNotFound:  # undeployed between the listing and the read
            continue
        wanted[(doc["name"], str(doc["version"]))] = doc["artifact"]
    return wanted


def sync_once(repository: ModelRepository, store) -> None:
    try:
        failures = repository.sync(wanted_deployments(store))
    except (StoreError, KeyError, TypeError) as err:
        log.warning("deployment sync: cannot read the store's deployments: %s", err)
        return
    for failure in failures:
        log.warning("deployment sync: %s", failure)


class DeploymentSync:
    def __init__(self, repository: ModelRepository, store, interval: float):
        self.repository, self.store, self.interval = repository, store, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        sync_once(self.repository, self.store)  # serve what is deployed from the first request
        if self.interval > 0:
            self._thread = threading.Thread(target=self._loop, name="kiln-sync", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            sync_once(self.repository, self.store)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
