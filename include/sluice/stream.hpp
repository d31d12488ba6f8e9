#pragma once
// The weight stream, all of it: the format (packets, chunks, a whole stream:
// sluice/stream_packets.hpp), its chunks' memory (sluice/chunk_memory.hpp), the validator
// (sluice/stream_validator.hpp), encoding and serialisation (sluice/stream_codec.hpp), the
// bounded channel (sluice/stream_channel.hpp) and where an engine reads a stream from
// (sluice/stream_sources.hpp).
#include "sluice/chunk_memory.hpp"
#include "sluice/stream_channel.hpp"
#include "sluice/stream_codec.hpp"
#include "sluice/stream_packets.hpp"
#include "sluice/stream_sources.hpp"
#include "sluice/stream_validator.hpp"
