// See ../README.md: declarations only, for ProcessGroupGloo.hpp.
#pragma once
#include "gloo/context.h"
