// dibs/version.hpp: the library's version, for code that must check it.
#pragma once

#define DIBS_VERSION_MAJOR 0
#define DIBS_VERSION_MINOR 1
#define DIBS_VERSION_PATCH 0
/// major * 10000 + minor * 100 + patch, as fmt's FMT_VERSION.
#define DIBS_VERSION (DIBS_VERSION_MAJOR * 10000 + DIBS_VERSION_MINOR * 100 + DIBS_VERSION_PATCH)
