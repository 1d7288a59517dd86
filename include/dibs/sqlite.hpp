// Deprecated: this path forwards to <dibs/sqlite/connection.hpp> for one release (0.2), then goes away.
#pragma once
#include <dibs/sqlite/connection.hpp>
