// Deprecated: this path forwards to <dibs/imap/client.hpp> for one release (0.2), then goes away.
#pragma once
#include <dibs/imap/client.hpp>
