// L2 planner core (csrc/l2_fill.cpp), registered into megatron_harts._C by call_planner.cpp.
#pragma once

#include <pybind11/pybind11.h>

void register_l2(pybind11::module_& m);
