# hiredis (libhiredis-dev), the client library of dibs::redis: makes the
# imported target dibs::hiredis if its header and library are found. Used by
# dibs's build and by its installed package (dibsConfig.cmake).
if(NOT TARGET dibs::hiredis)
  find_path(DIBS_HIREDIS_INCLUDE_DIR hiredis/hiredis.h)
  find_library(DIBS_HIREDIS_LIBRARY hiredis)
  if(DIBS_HIREDIS_INCLUDE_DIR AND DIBS_HIREDIS_LIBRARY)
    add_library(dibs::hiredis UNKNOWN IMPORTED)
    set_target_properties(dibs::hiredis PROPERTIES IMPORTED_LOCATION "${DIBS_HIREDIS_LIBRARY}"
                                                   INTERFACE_INCLUDE_DIRECTORIES "${DIBS_HIREDIS_INCLUDE_DIR}")
  endif()
endif()
