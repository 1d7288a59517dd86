#pragma once
// Deprecated (kept for one release): include <dibs/stores/file_store.hpp> instead.
#include <dibs/stores/file_store.hpp>
