// See ../../README.md: ProcessGroupGloo.hpp includes it and names nothing of it.
#pragma once
