// dibs/dibs.hpp: every part of dibs that needs only Boost headers and fmt.
// Adapters with a dependency of their own have their own header:
//   <dibs/sqlite.hpp>   (CMake target dibs::sqlite, links libsqlite3)
#pragma once

#include <dibs/backoff.hpp>
#include <dibs/dot_lock.hpp>
#include <dibs/error.hpp>
#include <dibs/file_mutex.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/lease_mutex.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/memory_store.hpp>
#include <dibs/retry.hpp>
#include <dibs/shared_log.hpp>
#include <dibs/shm_store.hpp>
#include <dibs/store.hpp>
#include <dibs/version.hpp>
