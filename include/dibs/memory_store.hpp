// Deprecated: this path forwards to <dibs/stores/memory_store.hpp> for one release (0.2), then goes away.
#pragma once
#include <dibs/detail/old_path.hpp>
#if DIBS_OLD_PATH_NOTE
#pragma message("<dibs/memory_store.hpp> is a path of dibs 0.1, kept for one release: include <dibs/stores/memory_store.hpp> (DIBS_NO_OLD_PATH_NOTES silences this)")
#endif
#include <dibs/stores/memory_store.hpp>
