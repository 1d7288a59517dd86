// Deprecated: this path forwards to <dibs/stores/sqlite_store.hpp> for one release (0.2), then goes away.
#pragma once
#include <dibs/stores/sqlite_store.hpp>
