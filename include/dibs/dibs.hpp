// dibs/dibs.hpp: every part of dibs that needs only Boost headers and fmt.
//
// The folders say what each header is:
//   <dibs/*.hpp>           the policies and utilities a program uses: retry,
//                          backoff, lease_mutex, lease_semaphore, lock_file, marker_claim,
//                          dot_lock, file_mutex, shared_log; the store concept
//   <dibs/stores/*.hpp>    the stores: memory, file, shm, and (with a target
//                          of their own) sqlite_store and postgres_store
//   <dibs/sqlite/*.hpp>    SQLite's connection for dibs::transact (dibs::sqlite)
//   <dibs/postgres/*.hpp>  PostgreSQL's connection (dibs::postgres, links libpq)
//   <dibs/imap/*.hpp>      the IMAP client, the store and the mailbox built on
//                          it (dibs::imap, links OpenSSL)
//   <dibs/detail/...>      internals; detail/posix/ and detail/win32/ hold
//                          the system calls
// Adapters with a dependency of their own are not included here. On
// Windows everything but shm_store (refused there: docs/windows.md says why).
#pragma once

#include <dibs/backoff.hpp>
#include <dibs/dot_lock.hpp>
#include <dibs/error.hpp>
#include <dibs/file_mutex.hpp>
#include <dibs/lease_mutex.hpp>
#include <dibs/lease_semaphore.hpp>
#include <dibs/lock_file.hpp>
#include <dibs/marker_claim.hpp>
#include <dibs/retry.hpp>
#include <dibs/shared_log.hpp>
#include <dibs/store.hpp>
#include <dibs/stores/file_store.hpp>
#include <dibs/stores/memory_store.hpp>
#ifndef _WIN32
#include <dibs/stores/shm_store.hpp>
#endif
#include <dibs/version.hpp>
