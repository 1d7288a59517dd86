// dibs/dibs.hpp: every part of dibs that needs only Boost headers and fmt.
//
// The folders say what each header is:
//   <dibs/*.hpp>           the policies and utilities a program uses: retry,
//                          backoff, lease_mutex, lock_file, marker_claim,
//                          dot_lock, file_mutex, shared_log; the store concept
//   <dibs/stores/*.hpp>    the stores: memory, file, shm, and (with a target
//                          of their own) sqlite_store and postgres_store
//   <dibs/sqlite/*.hpp>    SQLite's connection for dibs::transact (dibs::sqlite)
//   <dibs/postgres/*.hpp>  PostgreSQL's connection (dibs::postgres, links libpq)
//   <dibs/imap/*.hpp>      the IMAP client, the store and the mailbox built on
//                          it (dibs::imap, links OpenSSL)
//   <dibs/detail/...>      internals; detail/posix/ holds the system calls
// Adapters with a dependency of their own are not included here.
#pragma once

#ifdef _WIN32
#error "dibs/dibs.hpp is not ported to Windows yet; on Windows, dibs has file_mutex.hpp, retry.hpp, backoff.hpp, error.hpp, store.hpp, memory_store.hpp, marker_claim.hpp, dot_lock.hpp and testing/store_conformance.hpp (docs/windows.md)"
#endif

#include <dibs/backoff.hpp>
#include <dibs/dot_lock.hpp>
#include <dibs/error.hpp>
#include <dibs/file_mutex.hpp>
#include <dibs/lease_mutex.hpp>
#include <dibs/lock_file.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/retry.hpp>
#include <dibs/shared_log.hpp>
#include <dibs/store.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/stores/memory_store.hpp>
#include <dibs/stores/shm_store.hpp>
#include <dibs/version.hpp>
