"""``firehose.jetstream.ZstdCodec`` on its own (pure): each codec's frames name its dictionary and
are read back only with it."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import zstandard

from firehose.jetstream import LEGACY_DICTIONARY_ID, ZstdCodec


@pytest.mark.parametrize("make", [ZstdCodec.legacy, ZstdCodec.default])
def test_a_codec_round_trips_through_its_own_dictionary_only(make: Callable[[], ZstdCodec]) -> None:
    codec = make()
    data = json.dumps({"did": "did:plc:abc", "time_us": 1, "kind": "commit",
                       "commit": {"collection": "app.bsky.feed.post", "record": {"text": "hello"}}}).encode()
    packed = codec.compress(data)
    assert zstandard.get_frame_parameters(packed).dict_id == codec.dict_id
    assert not zstandard.get_frame_parameters(packed).has_checksum  # no checksum: 4 bytes less a message
    assert codec.decompressor().decompress(packed) == data
    with pytest.raises(zstandard.ZstdError):
        zstandard.ZstdDecompressor().decompress(packed)  # not readable without the dictionary
    other = ZstdCodec.default() if codec.dict_id == LEGACY_DICTIONARY_ID else ZstdCodec.legacy()
    assert other.dict_id != codec.dict_id
    with pytest.raises(zstandard.ZstdError):
        other.decompressor().decompress(packed)
