"""KV that landed at main decode after its request was answered (the relay finished it), kept
for a while so that whoever holds the request's id can learn when it landed
(``POST /v1/pdd/kv-landings``): the response was already sent and could not say."""

from collections import OrderedDict
from dataclasses import dataclass

MAX_IDS_PER_QUERY = 1024


@dataclass
class LateKv:
    """What the router heard about one request's prompt and KV, kept past its answer.

    Attributes:
        main_decode_id: The main decoder its KV was sent to (the only one believed about it).
        prefill_computed_unix_s: The prefill's clock when the prompt was computed (its
            ``PrefillCompleted``, which may itself come after the answer).
        prefill_compute_ms: The prompt's compute time, likewise.
        landed_unix_s: Main decode's clock when the last KV byte arrived (0: not heard).
        wan_kv_bytes: Bytes that came over the WAN for the request.
    """

    main_decode_id: str
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
        }


class KvLandings:
    """The latest ``max_entries`` requests' prompt ends and late landings, by request id (the
    oldest leave first)."""

    def __init__(self, max_entries: int = 4096):
        self._max_entries = max_entries
        self._entries: OrderedDict[str, LateKv] = OrderedDict()

    def expect(self, request_id: str, main_decode_id: str):
        """``request_id``'s KV is on its way to ``main_decode_id``."""
        self._entries[request_id] = LateKv(main_decode_id)
        self._entries.move_to_end(request_id)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def prefill_done(self, request_id: str, computed_unix_s: float, compute_ms: float):
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.prefill_computed_unix_s, entry.prefill_compute_ms = computed_unix_s, compute_ms

    def landed(self, request_id: str, sender: str, landed_unix_s: float, wan_kv_bytes: int):
        """Main decoder ``sender`` (proven by the subject it published on) says the KV landed;
        believed only from the decoder the KV was sent to."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.main_decode_id == sender:
            entry.landed_unix_s, entry.wan_kv_bytes = landed_unix_s, wan_kv_bytes

    def of(self, request_ids: list[str]) -> dict[str, LateKv]:
        """The landed ones among ``request_ids``."""
        entries = (self._entries.get(rid) for rid in request_ids)
        return {rid: e for rid, e in zip(request_ids, entries, strict=True) if e is not None and e.landed_unix_s}

    def __len__(self) -> int:
        return len(self._entries)
