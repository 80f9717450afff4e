// Stand-in: nccl.h includes this, but its host API uses no half types.
#pragma once
