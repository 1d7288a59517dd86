// Deprecated: this path forwards to <dibs/stores/postgres_store.hpp> for one release (0.2), then goes away.
#pragma once
#include <dibs/stores/postgres_store.hpp>
