// conveyor/version.h
#pragma once

#define CONVEYOR_VERSION_MAJOR 0
#define CONVEYOR_VERSION_MINOR 1
#define CONVEYOR_VERSION_PATCH 0
#define CONVEYOR_VERSION_STRING "0.1.0"
