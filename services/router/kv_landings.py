"""KV that landed at main decode after its request was answered (the relay finished it), kept
for a while so that whoever holds the request's id can learn when it landed
(``POST /v1/pdd/kv-landings``): the response was already sent and could not say."""

from collections import OrderedDict
from dataclasses import dataclass

from services.router.wan_estimate import WanEstimator
from shared.messages import KvReady

MAX_IDS_PER_QUERY = 1024


def kv_after_prefill_ms(prefill_computed_unix_s: float | None, kv_landed_unix_s: float | None) -> float | None:
    """From the prompt computed at the prefill to its last KV byte at main decode, on the two
    instances' clocks (one machine's in a benchmark); None without both."""
    if not (prefill_computed_unix_s and kv_landed_unix_s):
        return None
    return round((kv_landed_unix_s - prefill_computed_unix_s) * 1000, 1)


@dataclass
class LateKv:
    """What the router heard about one request's prompt and KV (its latest attempt's), kept
    past its answer.

    Attributes:
        main_decode_id: The main decoder its KV was sent to (the only one believed about it).
        attempt_id: The attempt that sent it (a recovered request runs under a new id).
        crosses_sites: Whether that decoder is at the other site (else no byte is the WAN's).
        prefill_computed_unix_s: The prefill's clock when the prompt was computed (its
            ``PrefillCompleted``, which may itself come after the answer).
        prefill_compute_ms: The prompt's compute time, likewise.
        landed_unix_s: Main decode's clock when the last KV byte arrived (0: not heard).
        wan_kv_bytes: Bytes that came over the WAN for the attempt.
    """

    main_decode_id: str
    attempt_id: str
    crosses_sites: bool = True
    prefill_computed_unix_s: float | None = None
    prefill_compute_ms: float | None = None
    landed_unix_s: float = 0.0
    wan_kv_bytes: int = 0

    def as_json(self) -> dict:
        return {
            "landed_unix_s": self.landed_unix_s,
            "wan_kv_bytes": self.wan_kv_bytes,
            "prefill_computed_unix_s": self.prefill_computed_unix_s,
            "prefill_compute_ms": self.prefill_compute_ms,
            "kv_after_prefill_ms": kv_after_prefill_ms(self.prefill_computed_unix_s, self.landed_unix_s),
        }


class KvLandings:
    """The latest ``max_entries`` requests' prompt ends and landings, by the request id the
    client holds (the oldest leave first); what arrives is filed by attempt id."""

    def __init__(self, max_entries: int = 4096):
        self._max_entries = max_entries
        self._entries: OrderedDict[str, LateKv] = OrderedDict()
        self._request_of_attempt: dict[str, str] = {}

    def expect(self, request_id: str, attempt_id: str, main_decode_id: str, crosses_sites: bool = True):
        """Attempt ``attempt_id`` of ``request_id`` sends its KV to ``main_decode_id``, at the
        other site or not (what an earlier attempt heard is dropped)."""
        earlier = self._entries.pop(request_id, None)
        if earlier is not None:
            self._request_of_attempt.pop(earlier.attempt_id, None)
        self._entries[request_id] = LateKv(main_decode_id, attempt_id, crosses_sites)
        self._request_of_attempt[attempt_id] = request_id
        while len(self._entries) > self._max_entries:
            _, oldest = self._entries.popitem(last=False)
            self._request_of_attempt.pop(oldest.attempt_id, None)

    def prefill_done(self, attempt_id: str, computed_unix_s: float, compute_ms: float):
        entry = self._of_attempt(attempt_id)
        if entry is not None:
            entry.prefill_computed_unix_s, entry.prefill_compute_ms = computed_unix_s, compute_ms

    def landed(self, attempt_id: str, sender: str, landed_unix_s: float, wan_kv_bytes: int):
        """Main decoder ``sender`` says the attempt's KV landed; believed only from the decoder
        the KV was sent to (the caller proves ``sender``: the subject it published on)."""
        entry = self._of_attempt(attempt_id)
        if entry is not None and entry.main_decode_id == sender:
            entry.landed_unix_s = landed_unix_s
            entry.wan_kv_bytes = wan_kv_bytes if entry.crosses_sites else 0

    def of(self, request_ids: list[str]) -> dict[str, LateKv]:
        """The landed ones among ``request_ids``."""
        entries = (self._entries.get(rid) for rid in request_ids)
        return {rid: e for rid, e in zip(request_ids, entries, strict=True) if e is not None and e.landed_unix_s}

    def supersede(self, attempt_id: str):
        """Attempt ``attempt_id`` failed and its request is being placed again: nothing it
        reports from now on is filed or believed (the new attempt's flow may go to the same
        main decoder before ``expect`` names it)."""
        self._request_of_attempt.pop(attempt_id, None)

    def request_of(self, attempt_id: str) -> str | None:
        """The request whose latest attempt is ``attempt_id``; None for an earlier attempt, or
        one no longer kept."""
        return self._request_of_attempt.get(attempt_id)

    def _of_attempt(self, attempt_id: str) -> LateKv | None:
        entry = self._entries.get(self._request_of_attempt.get(attempt_id, ""))
        return entry if entry is not None and entry.attempt_id == attempt_id else None

    def __len__(self) -> int:
        return len(self._entries)


def file_late_kv_ready(event: KvReady, sender: str, landings: KvLandings, wan: WanEstimator):
    """A ``KvReady`` for an attempt already answered (by the relay), from main decoder
    ``sender`` (its subject proves it): the attempt's flow has landed, and its throughput is a
    sample of the link as any flow's is (a deployment that relays most requests learns the
    link from those); its landing is kept for the request's holder. The link's ledger knows
    the flow by its request's id, the landings by the attempt's; each believes only the main
    decoder the KV went to."""
    landings.landed(event.request_id, sender, event.landed_unix_s, event.wan_kv_bytes)
    request_id = landings.request_of(event.request_id)
    if request_id is None or wan.main_decode_of(request_id) != sender:
        return
    wan.add_throughput(event.throughput_bps, event.wan_kv_bytes, request_id)
    wan.flow_landed(request_id, sender)
