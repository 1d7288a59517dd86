# For a cross build for Windows (the windows preset): SQLite, built here from
# its amalgamation as a static library, because Debian ships no SQLite for
# mingw-w64. Makes the target SQLite::SQLite3 (and sets SQLite3_FOUND), which
# dibs::sqlite links, as find_package(SQLite3) does on Linux.
#
# Where it comes from: the amalgamation (sqlite3.c, sqlite3.h; public domain)
# as the npm package better-sqlite3 ships it in package/deps/sqlite3/,
# fetched with `npm pack` from the npm registry at configure time. The
# package's tarball is checked against the SHA-256 pinned below and kept in
# a cache (DIBS_DOWNLOAD_CACHE, by default ~/.cache/dibs), so a second
# configure, or another build directory, downloads nothing. Nothing of it is
# in the repository.
#
# How it is built: with the options of Debian's libsqlite3 that matter for
# what a program sees (PRAGMA compile_options of Debian 12's libsqlite3-0,
# listed below), not with better-sqlite3's own (which turns foreign keys on,
# double-quoted strings off and WAL commits to synchronous=NORMAL).
include_guard(GLOBAL)
enable_language(C)

set(dibs_sqlite_package better-sqlite3)
set(dibs_sqlite_package_version 13.2.0)
set(dibs_sqlite_version 3.54.1)  # SQLITE_VERSION in that package's sqlite3.h
set(dibs_sqlite_sha256 40487589df3496f2ee0079d22b73c63fccebe7db0e8ee9a2c42421861e321e0b)

if(DEFINED ENV{XDG_CACHE_HOME} AND NOT "$ENV{XDG_CACHE_HOME}" STREQUAL "")
  set(dibs_cache_default $ENV{XDG_CACHE_HOME}/dibs)
else()
  set(dibs_cache_default $ENV{HOME}/.cache/dibs)
endif()
set(DIBS_DOWNLOAD_CACHE ${dibs_cache_default} CACHE PATH
    "Where the Windows cross build keeps what it downloads (SQLite's amalgamation)")

set(tarball ${DIBS_DOWNLOAD_CACHE}/${dibs_sqlite_package}-${dibs_sqlite_package_version}.tgz)
set(dibs_sqlite_dir ${CMAKE_BINARY_DIR}/_deps/sqlite-${dibs_sqlite_version})
set(stamp ${dibs_sqlite_dir}/sha256-of-tarball)

# Returns in `out`: TRUE if `file` exists and has the pinned checksum.
function(dibs_sqlite_tarball_ok file out)
  set(${out} FALSE PARENT_SCOPE)
  if(EXISTS ${file})
    file(SHA256 ${file} sum)
    if(sum STREQUAL dibs_sqlite_sha256)
      set(${out} TRUE PARENT_SCOPE)
    else()
      message(WARNING "dibs: ${file} has SHA-256 ${sum}, not the pinned ${dibs_sqlite_sha256}: fetching it again")
      file(REMOVE ${file})
    endif()
  endif()
endfunction()

set(extracted FALSE)
if(EXISTS ${stamp} AND EXISTS ${dibs_sqlite_dir}/sqlite3.c AND EXISTS ${dibs_sqlite_dir}/sqlite3.h)
  file(READ ${stamp} was)
  if(was STREQUAL dibs_sqlite_sha256)
    set(extracted TRUE)
  endif()
endif()

if(NOT extracted)
  dibs_sqlite_tarball_ok(${tarball} ok)
  if(NOT ok)
    find_program(DIBS_NPM npm)
    if(NOT DIBS_NPM)
      message(FATAL_ERROR
        "dibs: the Windows build needs SQLite's amalgamation, taken from the npm package "
        "${dibs_sqlite_package}@${dibs_sqlite_package_version}, and npm is not installed: run "
        "scripts/install-deps.sh windows, or put ${dibs_sqlite_package}-${dibs_sqlite_package_version}.tgz "
        "(SHA-256 ${dibs_sqlite_sha256}) in ${DIBS_DOWNLOAD_CACHE}")
    endif()
    # Into a directory of its own first: a download cut short never sits
    # in the cache under the final name.
    set(partial ${DIBS_DOWNLOAD_CACHE}/partial-${dibs_sqlite_package})
    file(REMOVE_RECURSE ${partial})
    file(MAKE_DIRECTORY ${partial})
    message(STATUS "dibs: fetching ${dibs_sqlite_package}@${dibs_sqlite_package_version} (SQLite ${dibs_sqlite_version}'s amalgamation) with npm")
    execute_process(COMMAND ${DIBS_NPM} pack ${dibs_sqlite_package}@${dibs_sqlite_package_version}
                            --pack-destination ${partial} --silent
                    WORKING_DIRECTORY ${partial}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    set(fetched ${partial}/${dibs_sqlite_package}-${dibs_sqlite_package_version}.tgz)
    if(NOT rc EQUAL 0 OR NOT EXISTS ${fetched})
      message(FATAL_ERROR "dibs: `npm pack ${dibs_sqlite_package}@${dibs_sqlite_package_version}` failed (${rc}): "
                          "${err}\nIs the npm registry reachable (npm config get registry)? Or put the tarball "
                          "(SHA-256 ${dibs_sqlite_sha256}) in ${DIBS_DOWNLOAD_CACHE}")
    endif()
    file(SHA256 ${fetched} sum)
    if(NOT sum STREQUAL dibs_sqlite_sha256)
      file(REMOVE_RECURSE ${partial})
      message(FATAL_ERROR "dibs: the npm registry's ${dibs_sqlite_package}-${dibs_sqlite_package_version}.tgz has "
                          "SHA-256 ${sum}, not the pinned ${dibs_sqlite_sha256}: refused (a changed package is "
                          "not built into dibs's tests)")
    endif()
    file(RENAME ${fetched} ${tarball})
    file(REMOVE_RECURSE ${partial})
  endif()
  file(REMOVE_RECURSE ${dibs_sqlite_dir})
  file(ARCHIVE_EXTRACT INPUT ${tarball} DESTINATION ${dibs_sqlite_dir}/x
       PATTERNS package/deps/sqlite3/sqlite3.c package/deps/sqlite3/sqlite3.h)
  foreach(f sqlite3.c sqlite3.h)
    if(NOT EXISTS ${dibs_sqlite_dir}/x/package/deps/sqlite3/${f})
      message(FATAL_ERROR "dibs: ${tarball} holds no package/deps/sqlite3/${f}")
    endif()
    file(RENAME ${dibs_sqlite_dir}/x/package/deps/sqlite3/${f} ${dibs_sqlite_dir}/${f})
  endforeach()
  file(REMOVE_RECURSE ${dibs_sqlite_dir}/x)
  file(WRITE ${stamp} ${dibs_sqlite_sha256})
endif()

file(STRINGS ${dibs_sqlite_dir}/sqlite3.h version_line REGEX "^#define SQLITE_VERSION +\"")
if(NOT version_line MATCHES "\"${dibs_sqlite_version}\"")
  message(FATAL_ERROR "dibs: ${dibs_sqlite_dir}/sqlite3.h is not SQLite ${dibs_sqlite_version}: ${version_line}")
endif()

add_library(dibs_sqlite3 STATIC ${dibs_sqlite_dir}/sqlite3.c)
target_include_directories(dibs_sqlite3 SYSTEM PUBLIC ${dibs_sqlite_dir})
# Its optimisation, when not the build type's: the windows presets build it
# at -O1 (at -O3 it was the longest compile of their build, 100 s; the
# tests under Wine do not need SQLite's fastest code).
set(DIBS_SQLITE3_OPTIMIZATION "" CACHE STRING "Optimisation flag for the bundled sqlite3.c (e.g. -O1); empty: the build type's")
if(DIBS_SQLITE3_OPTIMIZATION)
  target_compile_options(dibs_sqlite3 PRIVATE ${DIBS_SQLITE3_OPTIMIZATION})
endif()
# Debian 12's libsqlite3 (3.40.1), as PRAGMA compile_options lists it, less
# what only concerns Linux (MUTEX_PTHREADS: here MUTEX_W32) or speed alone.
# What a program can see: THREADSAFE=1 (serialized unless a connection asks
# for less, as dibs does with SQLITE_OPEN_NOMUTEX), USE_URI (a "file:" name is
# a URI), SECURE_DELETE, LIKE_DOESNT_MATCH_BLOBS, the limits, and the SQL
# that is there (FTS, R-tree, math functions, DELETE ... LIMIT).
target_compile_definitions(dibs_sqlite3 PRIVATE
  SQLITE_THREADSAFE=1
  SQLITE_USE_URI=1
  SQLITE_SECURE_DELETE
  SQLITE_LIKE_DOESNT_MATCH_BLOBS
  SQLITE_MAX_SCHEMA_RETRY=25
  SQLITE_MAX_VARIABLE_NUMBER=250000
  SQLITE_MAX_PAGE_COUNT=1073741823
  SQLITE_OMIT_LOOKASIDE=1
  SQLITE_SOUNDEX=1
  SQLITE_ENABLE_COLUMN_METADATA
  SQLITE_ENABLE_DBSTAT_VTAB
  SQLITE_ENABLE_FTS3
  SQLITE_ENABLE_FTS3_PARENTHESIS
  SQLITE_ENABLE_FTS3_TOKENIZER=1
  SQLITE_ENABLE_FTS4
  SQLITE_ENABLE_FTS5
  SQLITE_ENABLE_MATH_FUNCTIONS
  SQLITE_ENABLE_PREUPDATE_HOOK
  SQLITE_ENABLE_RTREE=1
  SQLITE_ENABLE_SESSION
  SQLITE_ENABLE_STMTVTAB
  SQLITE_ENABLE_UNLOCK_NOTIFY
  SQLITE_ENABLE_UPDATE_DELETE_LIMIT=1)
# SQLite's own code: its warnings are not dibs's to fix. Optimised at -O1
# whatever the build type: at -O3 its 250,000 lines were the longest compile
# of the windows preset's build (.ninja_log), and this SQLite serves the
# Windows tests, where its speed is not what is measured.
target_compile_options(dibs_sqlite3 PRIVATE -w $<$<NOT:$<CONFIG:Debug>>:-O1>)
set_target_properties(dibs_sqlite3 PROPERTIES POSITION_INDEPENDENT_CODE OFF)
add_library(SQLite::SQLite3 ALIAS dibs_sqlite3)
set(SQLite3_FOUND TRUE)
set(SQLite3_VERSION ${dibs_sqlite_version})
