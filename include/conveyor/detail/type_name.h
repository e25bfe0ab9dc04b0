// conveyor/detail/type_name.h: a type's name as its source spells it, for
// messages that name a user's dataset or sampler.
#pragma once

#include <string>
#include <typeinfo>

namespace conveyor::detail {

// "my::Stream" for typeid(my::Stream): demangled where the ABI allows,
// else the implementation's name.
std::string type_name(const std::type_info& type);

}  // namespace conveyor::detail
