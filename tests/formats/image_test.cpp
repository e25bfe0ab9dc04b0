// Tests of JPEG/PNG decode and encode (conveyor/image.h): round trips, a
// cross-check against PIL (fixtures below, and a live check when Python with
// PIL is installed), channel conversion, and every error path.
#include "conveyor/image.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/resource.h>
#include <turbojpeg.h>
#include <unistd.h>
#include <zlib.h>

#include "conveyor/data_error.h"
#include "conveyor/errors.h"

#include "support/image_bombs.h"
#include "support/memory_cap.h"

namespace conveyor {
namespace {

// ---- fixtures -------------------------------------------------------------------
// Written and decoded by PIL 9.4 (libjpeg-turbo 2.1.5, zlib 1.2.13): each
// *Pixels array is PIL's decode (convert("RGB") or ("L")), interleaved HWC.
// Regenerate with /usr/bin/python3 and this script, printing them:
//   import io, struct, zlib
//   from PIL import Image, PngImagePlugin
//
//   def arr(name, data):
//       body = ", ".join(str(b) for b in data)
//       return "constexpr uint8_t %s[] = {%s};\n" % (name, body)
//
//   def save(img, fmt, **kw):
//       b = io.BytesIO(); img.save(b, fmt, **kw); return b.getvalue()
//
//   def decoded(data, mode):
//       return Image.open(io.BytesIO(data)).convert(mode).tobytes()
//
//   out = []
//   rgb = Image.new("RGB", (13, 9))
//   rgb.putdata([((x * 19 + y * 7) % 256, (y * 27 + 40) % 256, (200 - x * 9 - y * 5) % 256)
//                for y in range(9) for x in range(13)])
//   for name, kw in (("kPilRgbJpeg", {}), ("kPilProgressiveJpeg", {"progressive": True})):
//       data = save(rgb, "JPEG", quality=90, **kw)
//       out += [arr(name, data), arr(name + "Pixels", decoded(data, "RGB"))]
//   grey = Image.new("L", (11, 7))
//   grey.putdata([(x * 23 + y * 11) % 256 for y in range(7) for x in range(11)])
//   data = save(grey, "JPEG", quality=90)
//   out += [arr("kPilGreyJpeg", data), arr("kPilGreyJpegPixels", decoded(data, "L"))]
//   cmyk = Image.new("CMYK", (6, 5))
//   cmyk.putdata([(x * 40, y * 50, (x + y) * 20, (x * y * 9) % 256)
//                 for y in range(5) for x in range(6)])
//   data = save(cmyk, "JPEG", quality=95)
//   out += [arr("kPilCmykJpeg", data), arr("kPilCmykJpegPixels", decoded(data, "RGB"))]
//   alphas = [0, 1, 77, 128, 200, 254, 255]
//   rgba = Image.new("RGBA", (5, 4))
//   rgba.putdata([(x * 50 + 3, y * 60 + 7, 100 + x * y * 9, alphas[(x * 4 + y) % 7])
//                 for y in range(4) for x in range(5)])
//   data = save(rgba, "PNG")
//   out += [arr("kPilRgbaPng", data), arr("kPilRgbaPngPixels", decoded(data, "RGB"))]
//   la = Image.new("LA", (4, 3))
//   la.putdata([(x * 60 + y * 5, alphas[(x + y * 4) % 7]) for y in range(3) for x in range(4)])
//   data = save(la, "PNG")
//   out += [arr("kPilGreyAlphaPng", data), arr("kPilGreyAlphaPngPixels", decoded(data, "L"))]
//   pal = Image.new("P", (4, 2))
//   pal.putpalette([i * 7 % 256 for i in range(24)])
//   pal.putdata(list(range(8)))
//   data = save(pal, "PNG", transparency=bytes([0, 128, 255, 10, 200, 0, 255, 255]))
//   out += [arr("kPilTransparentPalettePng", data),
//           arr("kPilTransparentPalettePngPixels", decoded(data, "RGB"))]
//   g16 = Image.new("I;16", (5, 3))
//   g16.putdata([x * 13107 + y * 257 * 3 for y in range(3) for x in range(5)])
//   out.append(arr("kPil16BitGreyPng", save(g16, "PNG")))
//   gamma = Image.new("L", (4, 1))
//   gamma.putdata([0, 64, 128, 255])
//   for name, value in (("kPilGamma1Png", 100000), ("kPilGamma045Png", 45455)):
//       info = PngImagePlugin.PngInfo()
//       info.add(b"gAMA", struct.pack(">I", value))
//       out.append(arr(name, save(gamma, "PNG", pnginfo=info)))
//   print("\n".join(out))

constexpr uint8_t kPilRgbJpeg[] = {
    255, 216, 255, 224, 0,   16,  74,  70,  73,  70,  0,   1,   1,   0,   0,   1,   0,   1,   0,
    0,   255, 219, 0,   67,  0,   3,   2,   2,   3,   2,   2,   3,   3,   3,   3,   4,   3,   3,
    4,   5,   8,   5,   5,   4,   4,   5,   10,  7,   7,   6,   8,   12,  10,  12,  12,  11,  10,
    11,  11,  13,  14,  18,  16,  13,  14,  17,  14,  11,  11,  16,  22,  16,  17,  19,  20,  21,
    21,  21,  12,  15,  23,  24,  22,  20,  24,  18,  20,  21,  20,  255, 219, 0,   67,  1,   3,
    4,   4,   5,   4,   5,   9,   5,   5,   9,   20,  13,  11,  13,  20,  20,  20,  20,  20,  20,
    20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,
    20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,
    20,  20,  20,  20,  20,  20,  255, 192, 0,   17,  8,   0,   9,   0,   13,  3,   1,   34,  0,
    2,   17,  1,   3,   17,  1,   255, 196, 0,   31,  0,   0,   1,   5,   1,   1,   1,   1,   1,
    1,   0,   0,   0,   0,   0,   0,   0,   0,   1,   2,   3,   4,   5,   6,   7,   8,   9,   10,
    11,  255, 196, 0,   181, 16,  0,   2,   1,   3,   3,   2,   4,   3,   5,   5,   4,   4,   0,
    0,   1,   125, 1,   2,   3,   0,   4,   17,  5,   18,  33,  49,  65,  6,   19,  81,  97,  7,
    34,  113, 20,  50,  129, 145, 161, 8,   35,  66,  177, 193, 21,  82,  209, 240, 36,  51,  98,
    114, 130, 9,   10,  22,  23,  24,  25,  26,  37,  38,  39,  40,  41,  42,  52,  53,  54,  55,
    56,  57,  58,  67,  68,  69,  70,  71,  72,  73,  74,  83,  84,  85,  86,  87,  88,  89,  90,
    99,  100, 101, 102, 103, 104, 105, 106, 115, 116, 117, 118, 119, 120, 121, 122, 131, 132, 133,
    134, 135, 136, 137, 138, 146, 147, 148, 149, 150, 151, 152, 153, 154, 162, 163, 164, 165, 166,
    167, 168, 169, 170, 178, 179, 180, 181, 182, 183, 184, 185, 186, 194, 195, 196, 197, 198, 199,
    200, 201, 202, 210, 211, 212, 213, 214, 215, 216, 217, 218, 225, 226, 227, 228, 229, 230, 231,
    232, 233, 234, 241, 242, 243, 244, 245, 246, 247, 248, 249, 250, 255, 196, 0,   31,  1,   0,
    3,   1,   1,   1,   1,   1,   1,   1,   1,   1,   0,   0,   0,   0,   0,   0,   1,   2,   3,
    4,   5,   6,   7,   8,   9,   10,  11,  255, 196, 0,   181, 17,  0,   2,   1,   2,   4,   4,
    3,   4,   7,   5,   4,   4,   0,   1,   2,   119, 0,   1,   2,   3,   17,  4,   5,   33,  49,
    6,   18,  65,  81,  7,   97,  113, 19,  34,  50,  129, 8,   20,  66,  145, 161, 177, 193, 9,
    35,  51,  82,  240, 21,  98,  114, 209, 10,  22,  36,  52,  225, 37,  241, 23,  24,  25,  26,
    38,  39,  40,  41,  42,  53,  54,  55,  56,  57,  58,  67,  68,  69,  70,  71,  72,  73,  74,
    83,  84,  85,  86,  87,  88,  89,  90,  99,  100, 101, 102, 103, 104, 105, 106, 115, 116, 117,
    118, 119, 120, 121, 122, 130, 131, 132, 133, 134, 135, 136, 137, 138, 146, 147, 148, 149, 150,
    151, 152, 153, 154, 162, 163, 164, 165, 166, 167, 168, 169, 170, 178, 179, 180, 181, 182, 183,
    184, 185, 186, 194, 195, 196, 197, 198, 199, 200, 201, 202, 210, 211, 212, 213, 214, 215, 216,
    217, 218, 226, 227, 228, 229, 230, 231, 232, 233, 234, 242, 243, 244, 245, 246, 247, 248, 249,
    250, 255, 218, 0,   12,  3,   1,   0,   2,   17,  3,   17,  0,   63,  0,   167, 225, 95,  217,
    135, 238, 127, 162, 127, 227, 181, 209, 248, 175, 225, 108, 126, 2,   142, 198, 17,  163, 166,
    161, 53,  194, 179, 180, 98,  97,  27,  70,  163, 0,   18,  54,  158, 14,  91,  29,  62,  233,
    175, 135, 60,  41,  252, 21,  204, 252, 103, 255, 0,   145, 158, 203, 254, 188, 19,  255, 0,
    70,  73,  94,  247, 19,  229, 25,  150, 47,  48,  84,  234, 227, 111, 29,  116, 228, 127, 164,
    207, 188, 192, 240, 246, 117, 195, 252, 49,  60,  102, 95,  153, 242, 213, 188, 82,  151, 178,
    78,  215, 122, 232, 230, 211, 186, 86,  213, 117, 190, 231, 255, 217};

constexpr uint8_t kPilRgbJpegPixels[] = {
    15,  40,  169, 20,  44,  168, 28,  49,  166, 43,  51,  162, 65,  46,  161, 88,  44,  155, 113,
    42,  148, 131, 42,  134, 138, 41,  110, 165, 52,  106, 187, 47,  96,  200, 39,  83,  228, 46,
    94,  23,  62,  179, 30,  66,  178, 44,  69,  172, 60,  70,  168, 76,  69,  165, 100, 66,  160,
    126, 64,  150, 144, 64,  137, 165, 77,  127, 172, 70,  107, 191, 66,  96,  218, 71,  99,  233,
    68,  98,  23,  93,  181, 36,  93,  180, 59,  92,  173, 76,  92,  167, 86,  95,  160, 106, 95,
    151, 135, 91,  142, 155, 91,  126, 163, 92,  106, 175, 95,  94,  198, 101, 94,  219, 104, 97,
    229, 95,  94,  24,  120, 180, 38,  120, 176, 63,  119, 168, 81,  118, 160, 92,  121, 151, 113,
    121, 142, 141, 117, 131, 161, 117, 116, 178, 123, 103, 192, 127, 97,  200, 124, 92,  205, 129,
    95,  203, 140, 105, 33,  148, 175, 42,  151, 172, 59,  153, 161, 79,  153, 152, 100, 151, 144,
    122, 149, 134, 148, 148, 124, 167, 147, 112, 183, 142, 96,  204, 151, 99,  210, 148, 99,  185,
    156, 100, 75,  122, 52,  40,  173, 172, 47,  177, 167, 61,  181, 156, 81,  181, 145, 106, 177,
    137, 129, 175, 126, 150, 175, 117, 171, 174, 105, 197, 175, 99,  205, 170, 89,  212, 174, 99,
    195, 207, 123, 38,  155, 50,  51,  198, 170, 60,  201, 166, 73,  206, 153, 92,  206, 144, 117,
    203, 132, 138, 203, 123, 155, 205, 110, 175, 204, 98,  197, 200, 87,  213, 203, 88,  222, 216,
    104, 175, 220, 101, 43,  190, 50,  96,  197, 205, 106, 200, 200, 124, 202, 189, 143, 203, 178,
    166, 199, 168, 185, 200, 159, 200, 203, 146, 220, 202, 136, 243, 201, 125, 255, 208, 128, 237,
    209, 126, 138, 161, 71,  85,  190, 87,  27,  21,  129, 39,  22,  126, 63,  22,  116, 84,  20,
    106, 106, 19,  97,  122, 20,  86,  138, 23,  78,  156, 23,  66,  177, 23,  57,  176, 29,  55,
    154, 48,  62,  53,  0,   0,   16,  12,  11};

constexpr uint8_t kPilProgressiveJpeg[] = {
    255, 216, 255, 224, 0,   16,  74,  70,  73,  70,  0,   1,   1,   0,   0,   1,   0,   1,   0,
    0,   255, 219, 0,   67,  0,   3,   2,   2,   3,   2,   2,   3,   3,   3,   3,   4,   3,   3,
    4,   5,   8,   5,   5,   4,   4,   5,   10,  7,   7,   6,   8,   12,  10,  12,  12,  11,  10,
    11,  11,  13,  14,  18,  16,  13,  14,  17,  14,  11,  11,  16,  22,  16,  17,  19,  20,  21,
    21,  21,  12,  15,  23,  24,  22,  20,  24,  18,  20,  21,  20,  255, 219, 0,   67,  1,   3,
    4,   4,   5,   4,   5,   9,   5,   5,   9,   20,  13,  11,  13,  20,  20,  20,  20,  20,  20,
    20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,
    20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,
    20,  20,  20,  20,  20,  20,  255, 194, 0,   17,  8,   0,   9,   0,   13,  3,   1,   34,  0,
    2,   17,  1,   3,   17,  1,   255, 196, 0,   22,  0,   1,   1,   1,   0,   0,   0,   0,   0,
    0,   0,   0,   0,   0,   0,   0,   0,   5,   3,   7,   255, 196, 0,   21,  1,   1,   1,   0,
    0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   4,   5,   255, 218, 0,   12,
    3,   1,   0,   2,   16,  3,   16,  0,   0,   1,   138, 56,  113, 143, 189, 255, 196, 0,   25,
    16,  0,   2,   3,   1,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   4,
    1,   5,   6,   52,  255, 218, 0,   8,   1,   1,   0,   1,   5,   2,   87,  48,  53,  87,  8,
    66,  165, 207, 79,  255, 196, 0,   29,  17,  0,   0,   5,   5,   0,   0,   0,   0,   0,   0,
    0,   0,   0,   0,   0,   0,   0,   3,   4,   5,   33,  1,   2,   17,  18,  225, 255, 218, 0,
    8,   1,   3,   1,   1,   63,  1,   33,  189, 107, 123, 101, 78,  78,  167, 23,  68,  235, 209,
    255, 196, 0,   28,  17,  0,   1,   3,   5,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
    0,   0,   4,   0,   2,   3,   5,   18,  33,  113, 225, 255, 218, 0,   8,   1,   2,   1,   1,
    63,  1,   169, 136, 76,  164, 90,  233, 177, 174, 175, 255, 196, 0,   29,  16,  0,   0,   5,
    5,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   1,   2,   17,  19,  16,
    50,  65,  114, 193, 255, 218, 0,   8,   1,   1,   0,   6,   63,  2,   180, 32,  161, 144, 213,
    135, 102, 162, 52,  233, 143, 255, 196, 0,   29,  16,  0,   2,   1,   4,   3,   0,   0,   0,
    0,   0,   0,   0,   0,   0,   0,   0,   0,   1,   145, 17,  33,  49,  65,  113, 161, 193, 255,
    218, 0,   8,   1,   1,   0,   1,   63,  33,  199, 228, 166, 50,  77,  187, 164, 142, 96,  212,
    235, 67,  255, 218, 0,   12,  3,   1,   0,   2,   0,   3,   0,   0,   0,   16,  67,  255, 196,
    0,   25,  17,  1,   1,   1,   0,   3,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,
    1,   17,  33,  0,   49,  65,  255, 218, 0,   8,   1,   3,   1,   1,   63,  16,  212, 202, 8,
    178, 187, 139, 26,  19,  79,  111, 124, 255, 196, 0,   24,  17,  0,   2,   3,   0,   0,   0,
    0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   17,  33,  0,   1,   193, 255, 218, 0,   8,
    1,   2,   1,   1,   63,  16,  173, 22,  200, 242, 127, 255, 196, 0,   25,  16,  1,   1,   0,
    3,   1,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   1,   17,  0,   16,  49,  33,
    255, 218, 0,   8,   1,   1,   0,   1,   63,  16,  195, 18,  4,   16,  1,   1,   74,  241, 177,
    206, 183, 252, 255, 217};

constexpr uint8_t kPilProgressiveJpegPixels[] = {
    15,  40,  169, 20,  44,  168, 28,  49,  166, 43,  51,  162, 65,  46,  161, 88,  44,  155, 113,
    42,  148, 131, 42,  134, 138, 41,  110, 165, 52,  106, 187, 47,  96,  200, 39,  83,  228, 46,
    94,  23,  62,  179, 30,  66,  178, 44,  69,  172, 60,  70,  168, 76,  69,  165, 100, 66,  160,
    126, 64,  150, 144, 64,  137, 165, 77,  127, 172, 70,  107, 191, 66,  96,  218, 71,  99,  233,
    68,  98,  23,  93,  181, 36,  93,  180, 59,  92,  173, 76,  92,  167, 86,  95,  160, 106, 95,
    151, 135, 91,  142, 155, 91,  126, 163, 92,  106, 175, 95,  94,  198, 101, 94,  219, 104, 97,
    229, 95,  94,  24,  120, 180, 38,  120, 176, 63,  119, 168, 81,  118, 160, 92,  121, 151, 113,
    121, 142, 141, 117, 131, 161, 117, 116, 178, 123, 103, 192, 127, 97,  200, 124, 92,  205, 129,
    95,  203, 140, 105, 33,  148, 175, 42,  151, 172, 59,  153, 161, 79,  153, 152, 100, 151, 144,
    122, 149, 134, 148, 148, 124, 167, 147, 112, 183, 142, 96,  204, 151, 99,  210, 148, 99,  185,
    156, 100, 75,  122, 52,  40,  173, 172, 47,  177, 167, 61,  181, 156, 81,  181, 145, 106, 177,
    137, 129, 175, 126, 150, 175, 117, 171, 174, 105, 197, 175, 99,  205, 170, 89,  212, 174, 99,
    195, 207, 123, 38,  155, 50,  51,  198, 170, 60,  201, 166, 73,  206, 153, 92,  206, 144, 117,
    203, 132, 138, 203, 123, 155, 205, 110, 175, 204, 98,  197, 200, 87,  213, 203, 88,  222, 216,
    104, 175, 220, 101, 43,  190, 50,  96,  197, 205, 106, 200, 200, 124, 202, 189, 143, 203, 178,
    166, 199, 168, 185, 200, 159, 200, 203, 146, 220, 202, 136, 243, 201, 125, 255, 208, 128, 237,
    209, 126, 138, 161, 71,  85,  190, 87,  27,  21,  129, 39,  22,  126, 63,  22,  116, 84,  20,
    106, 106, 19,  97,  122, 20,  86,  138, 23,  78,  156, 23,  66,  177, 23,  57,  176, 29,  55,
    154, 48,  62,  53,  0,   0,   16,  12,  11};

constexpr uint8_t kPilGreyJpeg[] = {
    255, 216, 255, 224, 0,   16,  74,  70,  73,  70,  0,   1,   1,   0,   0,   1,   0,   1,   0,
    0,   255, 219, 0,   67,  0,   3,   2,   2,   3,   2,   2,   3,   3,   3,   3,   4,   3,   3,
    4,   5,   8,   5,   5,   4,   4,   5,   10,  7,   7,   6,   8,   12,  10,  12,  12,  11,  10,
    11,  11,  13,  14,  18,  16,  13,  14,  17,  14,  11,  11,  16,  22,  16,  17,  19,  20,  21,
    21,  21,  12,  15,  23,  24,  22,  20,  24,  18,  20,  21,  20,  255, 192, 0,   11,  8,   0,
    7,   0,   11,  1,   1,   17,  0,   255, 196, 0,   31,  0,   0,   1,   5,   1,   1,   1,   1,
    1,   1,   0,   0,   0,   0,   0,   0,   0,   0,   1,   2,   3,   4,   5,   6,   7,   8,   9,
    10,  11,  255, 196, 0,   181, 16,  0,   2,   1,   3,   3,   2,   4,   3,   5,   5,   4,   4,
    0,   0,   1,   125, 1,   2,   3,   0,   4,   17,  5,   18,  33,  49,  65,  6,   19,  81,  97,
    7,   34,  113, 20,  50,  129, 145, 161, 8,   35,  66,  177, 193, 21,  82,  209, 240, 36,  51,
    98,  114, 130, 9,   10,  22,  23,  24,  25,  26,  37,  38,  39,  40,  41,  42,  52,  53,  54,
    55,  56,  57,  58,  67,  68,  69,  70,  71,  72,  73,  74,  83,  84,  85,  86,  87,  88,  89,
    90,  99,  100, 101, 102, 103, 104, 105, 106, 115, 116, 117, 118, 119, 120, 121, 122, 131, 132,
    133, 134, 135, 136, 137, 138, 146, 147, 148, 149, 150, 151, 152, 153, 154, 162, 163, 164, 165,
    166, 167, 168, 169, 170, 178, 179, 180, 181, 182, 183, 184, 185, 186, 194, 195, 196, 197, 198,
    199, 200, 201, 202, 210, 211, 212, 213, 214, 215, 216, 217, 218, 225, 226, 227, 228, 229, 230,
    231, 232, 233, 234, 241, 242, 243, 244, 245, 246, 247, 248, 249, 250, 255, 218, 0,   8,   1,
    1,   0,   0,   63,  0,   195, 253, 139, 126, 17,  69,  254, 129, 242, 39,  240, 250, 86,  199,
    198, 127, 248, 40,  215, 196, 31,  134, 191, 21,  188, 83,  225, 15,  5,   248, 99,  194, 147,
    248, 123, 195, 247, 242, 105, 81,  75,  175, 88,  220, 53,  219, 203, 1,   242, 174, 25,  140,
    87,  106, 133, 76,  201, 41,  66,  0,   59,  54,  100, 3,   145, 95,  255, 217};

constexpr uint8_t kPilGreyJpegPixels[] = {
    0,   22,  45,  67,  92,  113, 137, 160, 184, 207, 225, 12,  35,  59,  80,  105,
    127, 150, 174, 200, 211, 248, 21,  44,  68,  89,  114, 136, 159, 183, 199, 239,
    247, 33,  56,  80,  101, 126, 148, 171, 195, 216, 239, 7,   44,  67,  91,  112,
    137, 159, 182, 206, 233, 247, 18,  54,  78,  101, 123, 148, 169, 193, 216, 235,
    4,   32,  66,  89,  113, 134, 159, 181, 204, 228, 255, 15,  39};

constexpr uint8_t kPilCmykJpeg[] = {
    255, 216, 255, 238, 0,   14,  65,  100, 111, 98,  101, 0,   100, 0,   0,   0,   0,   0,   255,
    219, 0,   67,  0,   2,   1,   1,   1,   1,   1,   2,   1,   1,   1,   2,   2,   2,   2,   2,
    4,   3,   2,   2,   2,   2,   5,   4,   4,   3,   4,   6,   5,   6,   6,   6,   5,   6,   6,
    6,   7,   9,   8,   6,   7,   9,   7,   6,   6,   8,   11,  8,   9,   10,  10,  10,  10,  10,
    6,   8,   11,  12,  11,  10,  12,  9,   10,  10,  10,  255, 192, 0,   20,  8,   0,   5,   0,
    6,   4,   67,  17,  0,   77,  17,  0,   89,  17,  0,   75,  17,  0,   255, 196, 0,   31,  0,
    0,   1,   5,   1,   1,   1,   1,   1,   1,   0,   0,   0,   0,   0,   0,   0,   0,   1,   2,
    3,   4,   5,   6,   7,   8,   9,   10,  11,  255, 196, 0,   181, 16,  0,   2,   1,   3,   3,
    2,   4,   3,   5,   5,   4,   4,   0,   0,   1,   125, 1,   2,   3,   0,   4,   17,  5,   18,
    33,  49,  65,  6,   19,  81,  97,  7,   34,  113, 20,  50,  129, 145, 161, 8,   35,  66,  177,
    193, 21,  82,  209, 240, 36,  51,  98,  114, 130, 9,   10,  22,  23,  24,  25,  26,  37,  38,
    39,  40,  41,  42,  52,  53,  54,  55,  56,  57,  58,  67,  68,  69,  70,  71,  72,  73,  74,
    83,  84,  85,  86,  87,  88,  89,  90,  99,  100, 101, 102, 103, 104, 105, 106, 115, 116, 117,
    118, 119, 120, 121, 122, 131, 132, 133, 134, 135, 136, 137, 138, 146, 147, 148, 149, 150, 151,
    152, 153, 154, 162, 163, 164, 165, 166, 167, 168, 169, 170, 178, 179, 180, 181, 182, 183, 184,
    185, 186, 194, 195, 196, 197, 198, 199, 200, 201, 202, 210, 211, 212, 213, 214, 215, 216, 217,
    218, 225, 226, 227, 228, 229, 230, 231, 232, 233, 234, 241, 242, 243, 244, 245, 246, 247, 248,
    249, 250, 255, 218, 0,   14,  4,   67,  0,   77,  0,   89,  0,   75,  0,   0,   63,  0,   177,
    255, 0,   7,   29,  255, 0,   201, 126, 79,  251, 10,  73,  255, 0,   160, 189, 114, 191, 241,
    17,  23,  237, 191, 255, 0,   65,  15,  252, 169, 63,  255, 0,   19,  93,  55,  252, 20,  123,
    246, 219, 248, 179, 255, 0,   9,   250, 254, 251, 254, 94,  155, 254, 91,  159, 67,  237, 95,
    99,  255, 0,   193, 88,  127, 224, 166, 127, 31,  191, 101, 15,  137, 203, 225, 143, 134, 247,
    59,  45,  205, 227, 71,  143, 181, 50,  112, 3,   122, 3,   233, 95,  255, 217};

constexpr uint8_t kPilCmykJpegPixels[] = {
    255, 255, 255, 215, 255, 235, 175, 255, 215, 135, 255, 195, 96, 255, 175, 55, 253, 154,
    253, 203, 233, 207, 198, 208, 163, 191, 181, 121, 183, 157, 83, 177, 134, 45, 169, 111,
    255, 155, 215, 202, 145, 183, 151, 134, 151, 106, 122, 122, 69, 111, 96,  36, 100, 74,
    254, 105, 194, 192, 94,  157, 137, 82,  122, 91,  71,  92,  55, 61,  66,  26, 50,  45,
    255, 55,  175, 185, 47,  134, 127, 40,  98,  78,  32,  66,  42, 24,  42,  16, 16,  22};

constexpr uint8_t kPilRgbaPng[] = {
    137, 80,  78,  71,  13,  10,  26,  10, 0,   0,   0,   13,  73,  72,  68,  82,  0,   0,
    0,   5,   0,   0,   0,   4,   8,   6,  0,   0,   0,   70,  51,  245, 64,  0,   0,   0,
    69,  73,  68,  65,  84,  120, 156, 45, 200, 193, 9,   128, 32,  20,  0,   208, 39,  9,
    225, 213, 171, 91,  124, 33,  8,   28, 33,  104, 137, 22,  105, 59,  151, 10,  186, 120,
    124, 47,  109, 251, 35,  152, 193, 25, 124, 193, 157, 13,  137, 114, 80,  46,  74,  162,
    244, 108, 88,  168, 157, 154, 168, 51, 27,  250, 202, 73,  123, 105, 199, 15,  128, 167,
    8,   172, 204, 64,  97,  180, 0,   0,  0,   0,   73,  69,  78,  68,  174, 66,  96,  130};

constexpr uint8_t kPilRgbaPngPixels[] = {
    3, 7,   100, 53, 7,   100, 103, 7,   100, 153, 7,   100, 203, 7,   100,
    3, 67,  100, 53, 67,  109, 103, 67,  118, 153, 67,  127, 203, 67,  136,
    3, 127, 100, 53, 127, 118, 103, 127, 136, 153, 127, 154, 203, 127, 172,
    3, 187, 100, 53, 187, 127, 103, 187, 154, 153, 187, 181, 203, 187, 208};

constexpr uint8_t kPilGreyAlphaPng[] = {
    137, 80,  78,  71,  13,  10,  26,  10,  0,   0,   0,   13,  73,  72, 68,  82, 0,   0,   0,
    4,   0,   0,   0,   3,   8,   4,   0,   0,   0,   30,  253, 102, 77, 0,   0,  0,   35,  73,
    68,  65,  84,  120, 156, 99,  100, 96,  176, 97,  180, 241, 177, 49, 102, 97, 61,  193, 106,
    198, 202, 200, 202, 200, 194, 106, 201, 234, 195, 106, 204, 122, 2,  0,   47, 168, 3,   230,
    13,  120, 149, 229, 0,   0,   0,   0,   73,  69,  78,  68,  174, 66, 96,  130};

constexpr uint8_t kPilGreyAlphaPngPixels[] = {0, 60, 120, 180, 5, 65, 125, 185, 10, 70, 130, 190};

constexpr uint8_t kPilTransparentPalettePng[] = {
    137, 80,  78,  71,  13,  10,  26,  10,  0,   0,   0,   13,  73, 72,  68, 82,  0,   0,   0,
    4,   0,   0,   0,   2,   4,   3,   0,   0,   0,   141, 134, 96, 80,  0,  0,   0,   24,  80,
    76,  84,  69,  0,   7,   14,  21,  28,  35,  42,  49,  56,  63, 70,  77, 84,  91,  98,  105,
    112, 119, 126, 133, 140, 147, 154, 161, 205, 148, 233, 180, 0,  0,   0,  8,   116, 82,  78,
    83,  0,   128, 255, 10,  200, 0,   255, 255, 156, 90,  223, 40, 0,   0,  0,   14,  73,  68,
    65,  84,  120, 156, 99,  96,  84,  102, 112, 77,  7,   0,   1,  136, 0,  209, 122, 144, 24,
    214, 0,   0,   0,   0,   73,  69,  78,  68,  174, 66,  96,  130};

constexpr uint8_t kPilTransparentPalettePngPixels[] = {0,   7,   14,  21,  28,  35,  42,  49,
                                                       56,  63,  70,  77,  84,  91,  98,  105,
                                                       112, 119, 126, 133, 140, 147, 154, 161};

constexpr uint8_t kPil16BitGreyPng[] = {
    137, 80, 78,  71,  13,  10, 26,  10, 0,  0,   0,  13,  73,  72,  68, 82,  0,  0,  0,
    5,   0,  0,   0,   3,   16, 0,   0,  0,  0,   46, 205, 70,  103, 0,  0,   0,  19, 73,
    68,  65, 84,  120, 156, 99, 100, 96, 48, 134, 2,  38,  102, 56,  64, 98,  2,  0,  45,
    84,  1,  218, 182, 31,  75, 171, 0,  0,  0,   0,  73,  69,  78,  68, 174, 66, 96, 130};

constexpr uint8_t kPilGamma1Png[] = {
    137, 80,  78, 71,  13,  10, 26, 10,  0,   0,   0,   13,  73, 72,  68, 82,  0,  0,
    0,   4,   0,  0,   0,   1,  8,  0,   0,   0,   0,   220, 87, 80,  17, 0,   0,  0,
    4,   103, 65, 77,  65,  0,  1,  134, 160, 49,  232, 150, 95, 0,   0,  0,   13, 73,
    68,  65,  84, 120, 156, 99, 96, 112, 104, 248, 15,  0,   2,  196, 1,  192, 56, 190,
    97,  145, 0,  0,   0,   0,  73, 69,  78,  68,  174, 66,  96, 130};
constexpr uint8_t kPilGamma045Png[] = {
    137, 80,  78, 71,  13,  10, 26, 10,  0,   0,   0,   13,  73, 72,  68, 82,  0,  0,
    0,   4,   0,  0,   0,   1,  8,  0,   0,   0,   0,   220, 87, 80,  17, 0,   0,  0,
    4,   103, 65, 77,  65,  0,  0,  177, 143, 11,  252, 97,  5,  0,   0,  0,   13, 73,
    68,  65,  84, 120, 156, 99, 96, 112, 104, 248, 15,  0,   2,  196, 1,  192, 56, 190,
    97,  145, 0,  0,   0,   0,  73, 69,  78,  68,  174, 66,  96, 130};

// A 4 x 1 RGBA PNG with 16-bit samples, written by hand (Python zlib and
// struct): pixels (1000, 30000, 65535, alpha 0), (65535, 25700, 0, 1),
// (12850, 15420, 17990, 30000), (12345, 54321, 40000, 65535).
constexpr uint8_t kHandmade16BitRgbaPng[] = {
    137, 80,  78,  71,  13, 10,  26, 10,  0,   0,   0,   13,  73,  72,  68,  82,  0,
    0,   0,   4,   0,   0,  0,   1,  16,  6,   0,   0,   0,   169, 172, 211, 142, 0,
    0,   0,   42,  73,  68, 65,  84, 120, 156, 99,  96,  126, 81,  106, 240, 255, 63,
    3,   195, 255, 255, 41, 41,  12, 12,  12,  140, 70,  70,  54,  54,  110, 110, 165,
    6,   6,   150, 87,  12, 231, 56, 252, 255, 15,  0,   206, 77,  12,  171, 252, 163,
    194, 118, 0,   0,   0,  0,   73, 69,  78,  68,  174, 66,  96,  130};

// A 10 x 6 RGB JPEG written with libjpeg directly (quality 90), luma sampled
// 3x1 and chroma 1x1: a layout TurboJPEG's header reader has no name for but
// libjpeg decodes; the pixels are PIL's decode.
constexpr uint8_t kLibjpegSampling3x1Jpeg[] = {
    255, 216, 255, 224, 0,   16,  74,  70,  73,  70,  0,   1,   1,   0,   0,   1,   0,   1,   0,
    0,   255, 219, 0,   67,  0,   3,   2,   2,   3,   2,   2,   3,   3,   3,   3,   4,   3,   3,
    4,   5,   8,   5,   5,   4,   4,   5,   10,  7,   7,   6,   8,   12,  10,  12,  12,  11,  10,
    11,  11,  13,  14,  18,  16,  13,  14,  17,  14,  11,  11,  16,  22,  16,  17,  19,  20,  21,
    21,  21,  12,  15,  23,  24,  22,  20,  24,  18,  20,  21,  20,  255, 219, 0,   67,  1,   3,
    4,   4,   5,   4,   5,   9,   5,   5,   9,   20,  13,  11,  13,  20,  20,  20,  20,  20,  20,
    20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,
    20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,  20,
    20,  20,  20,  20,  20,  20,  255, 192, 0,   17,  8,   0,   6,   0,   10,  3,   1,   49,  0,
    2,   17,  1,   3,   17,  1,   255, 196, 0,   31,  0,   0,   1,   5,   1,   1,   1,   1,   1,
    1,   0,   0,   0,   0,   0,   0,   0,   0,   1,   2,   3,   4,   5,   6,   7,   8,   9,   10,
    11,  255, 196, 0,   181, 16,  0,   2,   1,   3,   3,   2,   4,   3,   5,   5,   4,   4,   0,
    0,   1,   125, 1,   2,   3,   0,   4,   17,  5,   18,  33,  49,  65,  6,   19,  81,  97,  7,
    34,  113, 20,  50,  129, 145, 161, 8,   35,  66,  177, 193, 21,  82,  209, 240, 36,  51,  98,
    114, 130, 9,   10,  22,  23,  24,  25,  26,  37,  38,  39,  40,  41,  42,  52,  53,  54,  55,
    56,  57,  58,  67,  68,  69,  70,  71,  72,  73,  74,  83,  84,  85,  86,  87,  88,  89,  90,
    99,  100, 101, 102, 103, 104, 105, 106, 115, 116, 117, 118, 119, 120, 121, 122, 131, 132, 133,
    134, 135, 136, 137, 138, 146, 147, 148, 149, 150, 151, 152, 153, 154, 162, 163, 164, 165, 166,
    167, 168, 169, 170, 178, 179, 180, 181, 182, 183, 184, 185, 186, 194, 195, 196, 197, 198, 199,
    200, 201, 202, 210, 211, 212, 213, 214, 215, 216, 217, 218, 225, 226, 227, 228, 229, 230, 231,
    232, 233, 234, 241, 242, 243, 244, 245, 246, 247, 248, 249, 250, 255, 196, 0,   31,  1,   0,
    3,   1,   1,   1,   1,   1,   1,   1,   1,   1,   0,   0,   0,   0,   0,   0,   1,   2,   3,
    4,   5,   6,   7,   8,   9,   10,  11,  255, 196, 0,   181, 17,  0,   2,   1,   2,   4,   4,
    3,   4,   7,   5,   4,   4,   0,   1,   2,   119, 0,   1,   2,   3,   17,  4,   5,   33,  49,
    6,   18,  65,  81,  7,   97,  113, 19,  34,  50,  129, 8,   20,  66,  145, 161, 177, 193, 9,
    35,  51,  82,  240, 21,  98,  114, 209, 10,  22,  36,  52,  225, 37,  241, 23,  24,  25,  26,
    38,  39,  40,  41,  42,  53,  54,  55,  56,  57,  58,  67,  68,  69,  70,  71,  72,  73,  74,
    83,  84,  85,  86,  87,  88,  89,  90,  99,  100, 101, 102, 103, 104, 105, 106, 115, 116, 117,
    118, 119, 120, 121, 122, 130, 131, 132, 133, 134, 135, 136, 137, 138, 146, 147, 148, 149, 150,
    151, 152, 153, 154, 162, 163, 164, 165, 166, 167, 168, 169, 170, 178, 179, 180, 181, 182, 183,
    184, 185, 186, 194, 195, 196, 197, 198, 199, 200, 201, 202, 210, 211, 212, 213, 214, 215, 216,
    217, 218, 226, 227, 228, 229, 230, 231, 232, 233, 234, 242, 243, 244, 245, 246, 247, 248, 249,
    250, 255, 218, 0,   12,  3,   1,   0,   2,   17,  3,   17,  0,   63,  0,   228, 62,  29,  252,
    93,  186, 49,  90,  110, 137, 164, 146, 108, 237, 220, 120, 24,  199, 39,  243, 28,  87,  175,
    65,  241, 180, 180, 17,  159, 178, 245, 81,  255, 0,   44,  253, 191, 223, 162, 190, 31,  253,
    94,  225, 204, 36,  99,  79,  19,  133, 132, 165, 101, 171, 166, 228, 223, 123, 191, 107, 14,
    183, 210, 219, 91,  83,  244, 158, 19,  225, 168, 203, 40,  164, 212, 191, 175, 185, 159, 255,
    217};
constexpr uint8_t kLibjpegSampling3x1JpegPixels[] = {
    54,  189, 0,   63,  198, 0,   64,  199, 0,   106, 194, 0,   110, 198, 0,   119, 207, 9,
    160, 190, 0,   168, 198, 4,   173, 203, 9,   207, 206, 0,   43,  172, 0,   48,  177, 0,
    54,  183, 5,   99,  176, 34,  105, 182, 40,  109, 186, 44,  159, 161, 111, 174, 176, 126,
    175, 177, 127, 212, 179, 112, 36,  140, 19,  48,  152, 31,  59,  163, 42,  95,  141, 104,
    105, 151, 114, 117, 163, 126, 166, 140, 187, 167, 141, 188, 183, 157, 204, 215, 153, 226,
    36,  117, 22,  47,  128, 33,  61,  142, 47,  99,  114, 135, 110, 125, 146, 121, 136, 157,
    170, 132, 93,  161, 123, 84,  168, 130, 91,  206, 127, 96,  47,  89,  53,  47,  89,  53,
    63,  105, 69,  113, 97,  134, 114, 98,  135, 112, 96,  133, 160, 91,  94,  168, 99,  102,
    183, 114, 117, 218, 98,  204, 38,  66,  51,  47,  75,  60,  64,  92,  77,  114, 85,  113,
    100, 71,  99,  105, 76,  104, 165, 69,  106, 181, 85,  122, 166, 70,  107, 207, 75,  71};

// ---- helpers --------------------------------------------------------------------

// An [C, H, W] image whose value at (c, y, x) is value(c, y, x).
Array<uint8_t> make_image(int64_t channels, int64_t height, int64_t width,
                          const std::function<int(int64_t, int64_t, int64_t)>& value) {
  Array<uint8_t> image({channels, height, width});
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t y = 0; y < height; ++y) {
      for (int64_t x = 0; x < width; ++x) {
        image[static_cast<size_t>((c * height + y) * width + x)] =
            static_cast<uint8_t>(value(c, y, x));
      }
    }
  }
  return image;
}

// Smooth waves (JPEG's friendly content, but not trivially so), out of
// phase between channels so the colour varies too; values in [38, 218].
Array<uint8_t> smooth_image(int64_t channels, int64_t height, int64_t width) {
  return make_image(channels, height, width, [](int64_t c, int64_t y, int64_t x) {
    const double cc = static_cast<double>(c);
    return static_cast<int>(std::lround(128 + 50 * std::sin(0.4 * static_cast<double>(x) + cc) +
                                        40 * std::cos(0.3 * static_cast<double>(y) - cc)));
  });
}

// Uniform noise, which JPEG compresses badly: plenty of entropy-coded data.
Array<uint8_t> noise_image(int64_t channels, int64_t height, int64_t width, uint32_t seed) {
  std::mt19937 engine(seed);
  return make_image(channels, height, width, [&engine](int64_t, int64_t, int64_t) {
    return static_cast<int>(engine() % 256);
  });
}

std::vector<uint8_t> values_of(const Array<uint8_t>& image) {
  return {image.values().begin(), image.values().end()};
}

// Interleaved HWC -> planar [C, H, W].
std::vector<uint8_t> planar(const uint8_t* interleaved, int channels, int height, int width) {
  std::vector<uint8_t> out(static_cast<size_t>(channels * height * width));
  for (int c = 0; c < channels; ++c) {
    for (int i = 0; i < height * width; ++i) {
      out[c * height * width + i] = interleaved[i * channels + c];
    }
  }
  return out;
}

template <size_t N>
std::span<const uint8_t> span_of(const uint8_t (&bytes)[N]) {
  return {bytes, N};
}

double mean_abs_error(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  EXPECT_EQ(a.size(), b.size());
  double sum = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) sum += std::abs(int{a[i]} - int{b[i]});
  return a.empty() ? 0 : sum / static_cast<double>(a.size());
}

// ITU-R 601 luma, rounded as libjpeg and PIL round it.
uint8_t luma(int red, int green, int blue) {
  return static_cast<uint8_t>(std::lround(0.299 * red + 0.587 * green + 0.114 * blue));
}

// What decode_image throws for `bytes`, or "" when it does not throw a DataError.
std::string decode_error(std::span<const uint8_t> bytes, const std::string& name) {
  try {
    decode_image(bytes, name);
  } catch (const DataError& error) {
    EXPECT_EQ(error.file(), name);
    return error.what();
  }
  return "";
}

std::string info_error(std::span<const uint8_t> bytes, const std::string& name) {
  try {
    read_image_info(bytes, name);
  } catch (const DataError& error) {
    EXPECT_EQ(error.file(), name);
    return error.what();
  }
  return "";
}

// Offset of the first byte of entropy-coded data after the (first) SOS marker.
size_t jpeg_scan_start(const std::vector<uint8_t>& jpeg) {
  for (size_t i = 2; i + 3 < jpeg.size(); ++i) {
    if (jpeg[i] == 0xFF && jpeg[i + 1] == 0xDA) {
      return i + 2 + (size_t{jpeg[i + 2]} << 8 | jpeg[i + 3]);
    }
  }
  ADD_FAILURE() << "no SOS marker";
  return jpeg.size();
}

// Offset of the data of the first chunk of type `type`, and its length.
std::pair<size_t, size_t> png_chunk(const std::vector<uint8_t>& png, const char* type) {
  size_t at = 8;
  while (at + 12 <= png.size()) {
    const size_t length =
        size_t{png[at]} << 24 | size_t{png[at + 1]} << 16 | size_t{png[at + 2]} << 8 | png[at + 3];
    if (std::equal(type, type + 4, png.begin() + static_cast<std::ptrdiff_t>(at + 4))) {
      return {at + 8, length};
    }
    at += 12 + length;
  }
  ADD_FAILURE() << "no " << type << " chunk";
  return {png.size(), 0};
}

using conveyor::testing::exit_zero_if_under_cap;
using conveyor::testing::exit_zero_on_data_error_under_cap;

using conveyor::testing::jpeg_claiming;

void append_big_endian(std::vector<uint8_t>& bytes, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8)
    bytes.push_back(static_cast<uint8_t>(value >> shift));
}

void append_png_chunk(std::vector<uint8_t>& png, const char* type,
                      const std::vector<uint8_t>& data) {
  append_big_endian(png, static_cast<uint32_t>(data.size()));
  const size_t type_at = png.size();
  png.insert(png.end(), type, type + 4);
  png.insert(png.end(), data.begin(), data.end());
  append_big_endian(png, static_cast<uint32_t>(
                             crc32(0, png.data() + type_at, static_cast<uInt>(4 + data.size()))));
}

// A 69-byte PNG whose IHDR (with a correct CRC) claims width x height 8-bit
// RGB, with a token IDAT: 10^6 x 10^6 is within libpng's own limits and
// asks for 3 TB.
std::vector<uint8_t> png_claiming(uint32_t width, uint32_t height) {
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> header;
  append_big_endian(header, width);
  append_big_endian(header, height);
  header.insert(header.end(), {8, 2, 0, 0, 0});  // 8 bits, RGB, deflate, adaptive, progressive
  append_png_chunk(png, "IHDR", header);
  std::vector<uint8_t> row(4, 0);  // a filter byte and one pixel
  uLongf zipped_size = compressBound(row.size());
  std::vector<uint8_t> zipped(zipped_size);
  EXPECT_EQ(compress(zipped.data(), &zipped_size, row.data(), row.size()), Z_OK);
  zipped.resize(zipped_size);
  append_png_chunk(png, "IDAT", zipped);
  append_png_chunk(png, "IEND", {});
  return png;
}

// A 1x1 grey PNG whose one IDAT deflates the row (filter byte, value 77)
// followed by `trailing` zero bytes.
std::vector<uint8_t> one_pixel_png_with_trailing_data(size_t trailing) {
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> header;
  append_big_endian(header, 1);
  append_big_endian(header, 1);
  header.insert(header.end(), {8, 0, 0, 0, 0});  // 8 bits, grey, deflate, adaptive, progressive
  append_png_chunk(png, "IHDR", header);
  std::vector<uint8_t> raw(2 + trailing, 0);
  raw[1] = 77;
  uLongf zipped_size = compressBound(raw.size());
  std::vector<uint8_t> zipped(zipped_size);
  EXPECT_EQ(compress2(zipped.data(), &zipped_size, raw.data(), raw.size(), 9), Z_OK);
  zipped.resize(zipped_size);
  append_png_chunk(png, "IDAT", zipped);
  append_png_chunk(png, "IEND", {});
  return png;
}

// Sets the process-wide pixel limit for one scope, then restores it.
class ScopedMaxImagePixels {
 public:
  explicit ScopedMaxImagePixels(uint64_t pixels) : saved_(max_image_pixels()) {
    set_max_image_pixels(pixels);
  }
  ~ScopedMaxImagePixels() { set_max_image_pixels(saved_); }
  ScopedMaxImagePixels(const ScopedMaxImagePixels&) = delete;
  ScopedMaxImagePixels& operator=(const ScopedMaxImagePixels&) = delete;

 private:
  uint64_t saved_;
};

// ---- format sniffing and headers -------------------------------------------------

TEST(ImageSniff, RecognisesMagicBytes) {
  const std::vector<uint8_t> jpeg = encode_jpeg(smooth_image(3, 4, 4));
  const std::vector<uint8_t> png = encode_png(smooth_image(3, 4, 4));
  EXPECT_EQ(sniff_image_format(jpeg), ImageFormat::jpeg);
  EXPECT_EQ(sniff_image_format(png), ImageFormat::png);
  EXPECT_EQ(sniff_image_format(span_of(kPilGreyJpeg)), ImageFormat::jpeg);
  EXPECT_EQ(sniff_image_format(span_of(kPilTransparentPalettePng)), ImageFormat::png);
  EXPECT_EQ(sniff_image_format({}), ImageFormat::unknown);
  // Prefixes of the magic are too short to tell.
  EXPECT_EQ(sniff_image_format(std::span(jpeg).first(2)), ImageFormat::unknown);
  EXPECT_EQ(sniff_image_format(std::span(png).first(7)), ImageFormat::unknown);
  const std::vector<uint8_t> gif = {'G', 'I', 'F', '8', '9', 'a', 1, 0, 1, 0};
  EXPECT_EQ(sniff_image_format(gif), ImageFormat::unknown);
}

TEST(ImageInfoTest, ReadsHeaders) {
  const ImageInfo rgb_png = read_image_info(encode_png(smooth_image(3, 5, 7)), "rgb.png");
  EXPECT_EQ(rgb_png.width, 7);
  EXPECT_EQ(rgb_png.height, 5);
  EXPECT_EQ(rgb_png.channels, 3);
  const ImageInfo grey_jpeg = read_image_info(encode_jpeg(smooth_image(1, 9, 3)), "grey.jpg");
  EXPECT_EQ(grey_jpeg.width, 3);
  EXPECT_EQ(grey_jpeg.height, 9);
  EXPECT_EQ(grey_jpeg.channels, 1);
  const ImageInfo cmyk = read_image_info(span_of(kPilCmykJpeg), "cmyk.jpg");
  EXPECT_EQ(cmyk.width, 6);
  EXPECT_EQ(cmyk.height, 5);
  EXPECT_EQ(cmyk.channels, 3);
  const ImageInfo odd_sampling = read_image_info(span_of(kLibjpegSampling3x1Jpeg), "3x1.jpg");
  EXPECT_EQ(odd_sampling.width, 10);
  EXPECT_EQ(odd_sampling.height, 6);
  EXPECT_EQ(odd_sampling.channels, 3);
  const ImageInfo rgba = read_image_info(span_of(kPilRgbaPng), "rgba.png");
  EXPECT_EQ(rgba.channels, 3);  // alpha is not counted: decoding drops it
  EXPECT_EQ(read_image_info(span_of(kPilGreyAlphaPng), "la.png").channels, 1);
  EXPECT_EQ(read_image_info(span_of(kPil16BitGreyPng), "16.png").channels, 1);
  EXPECT_EQ(read_image_info(span_of(kPilTransparentPalettePng), "p.png").channels, 3);
}

// ---- round trips -------------------------------------------------------------------

TEST(PngRoundTrip, IsExactForGreyAndRgb) {
  for (int64_t channels : {1, 3}) {
    for (auto [height, width] : {std::pair<int64_t, int64_t>{5, 7}, {1, 1}, {13, 2}}) {
      const Array<uint8_t> image = noise_image(channels, height, width, 7);
      const Array<uint8_t> decoded = decode_image(encode_png(image), "round-trip.png");
      EXPECT_EQ(decoded.shape(), (std::vector<int64_t>{channels, height, width}));
      EXPECT_EQ(values_of(decoded), values_of(image)) << channels << "x" << height << "x" << width;
    }
  }
}

TEST(JpegRoundTrip, IsCloseAtQuality95) {
  for (int64_t channels : {1, 3}) {
    const Array<uint8_t> image = smooth_image(channels, 17, 33);
    const std::vector<uint8_t> jpeg = encode_jpeg(image, 95);
    const Array<uint8_t> decoded = decode_image(jpeg, "round-trip.jpg");
    ASSERT_EQ(decoded.shape(), image.shape());
    // Colour pays for 4:2:0 chroma subsampling (about 2.2 here; grey 0.23).
    const double error = mean_abs_error(decoded.values(), image.values());
    EXPECT_LT(error, channels == 1 ? 0.5 : 2.5) << channels << " channels";
    // Lower quality: smaller file, larger error, still the same picture.
    const std::vector<uint8_t> coarse = encode_jpeg(image, 20);
    EXPECT_LT(coarse.size(), jpeg.size());
    const double coarse_error =
        mean_abs_error(decode_image(coarse, "coarse.jpg").values(), image.values());
    EXPECT_GT(coarse_error, error);
    EXPECT_LT(coarse_error, 10);
  }
}

TEST(ImageDecodeInto, WritesOnlyTheCallersSlot) {
  const Array<uint8_t> image = noise_image(3, 5, 7, 11);
  const std::vector<uint8_t> png = encode_png(image);
  const std::vector<uint8_t> jpeg = encode_jpeg(image, 95);
  const Array<uint8_t> jpeg_decoded = decode_image(jpeg, "x.jpg");
  for (const auto* encoded : {&png, &jpeg}) {
    // A batch of three slots; only the middle one may change.
    std::vector<uint8_t> batch(3 * image.numel(), 0xAB);
    std::span<uint8_t> slot = std::span(batch).subspan(image.numel(), image.numel());
    const ImageInfo info = decode_image_into(*encoded, slot, "slot");
    EXPECT_EQ(info.width, 7);
    EXPECT_EQ(info.height, 5);
    EXPECT_EQ(info.channels, 3);
    const std::vector<uint8_t> expected = values_of(encoded == &png ? image : jpeg_decoded);
    EXPECT_TRUE(std::equal(slot.begin(), slot.end(), expected.begin()));
    EXPECT_TRUE(std::all_of(batch.begin(),
                            batch.begin() + static_cast<std::ptrdiff_t>(image.numel()),
                            [](uint8_t v) { return v == 0xAB; }));
    EXPECT_TRUE(std::all_of(batch.end() - static_cast<std::ptrdiff_t>(image.numel()), batch.end(),
                            [](uint8_t v) { return v == 0xAB; }));
  }
}

// ---- channel conversion ------------------------------------------------------------

TEST(ImageChannels, RgbToGreyIsLuma) {
  const Array<uint8_t> image = noise_image(3, 6, 5, 3);
  const Array<uint8_t> grey = decode_image(encode_png(image), "rgb.png", 1);
  ASSERT_EQ(grey.shape(), (std::vector<int64_t>{1, 6, 5}));
  const size_t plane = 30;
  for (size_t i = 0; i < plane; ++i) {
    ASSERT_EQ(grey[i], luma(image[i], image[plane + i], image[2 * plane + i])) << i;
  }
  // A colour JPEG read as grey is libjpeg's Y channel: the luma of its RGB
  // decode, up to the rounding of YCbCr -> RGB.
  const std::vector<uint8_t> jpeg = encode_jpeg(smooth_image(3, 16, 16), 95);
  const Array<uint8_t> rgb = decode_image(jpeg, "rgb.jpg");
  const Array<uint8_t> y = decode_image(jpeg, "rgb.jpg", 1);
  ASSERT_EQ(y.shape(), (std::vector<int64_t>{1, 16, 16}));
  for (size_t i = 0; i < 256; ++i) {
    ASSERT_NEAR(y[i], luma(rgb[i], rgb[256 + i], rgb[512 + i]), 2) << i;
  }
}

TEST(ImageChannels, GreyToRgbRepeatsThePlane) {
  const Array<uint8_t> image = noise_image(1, 4, 9, 5);
  const std::vector<uint8_t> png = encode_png(image);
  const std::vector<uint8_t> jpeg = encode_jpeg(image, 90);
  const std::vector<uint8_t> jpeg_grey = values_of(decode_image(jpeg, "g.jpg"));
  for (const auto& [encoded, grey] :
       {std::pair{&png, values_of(image)}, std::pair{&jpeg, jpeg_grey}}) {
    const Array<uint8_t> rgb = decode_image(*encoded, "grey", 3);
    ASSERT_EQ(rgb.shape(), (std::vector<int64_t>{3, 4, 9}));
    for (size_t c = 0; c < 3; ++c) {
      EXPECT_TRUE(std::equal(grey.begin(), grey.end(),
                             rgb.values().begin() + static_cast<std::ptrdiff_t>(c * 36)));
    }
    // channels = 1 on a grey image keeps it as it is.
    EXPECT_EQ(values_of(decode_image(*encoded, "grey", 1)), grey);
  }
}

// ---- against PIL -------------------------------------------------------------------------

TEST(JpegDecode, MatchesPil) {
  struct Case {
    const char* name;
    std::span<const uint8_t> file;
    std::span<const uint8_t> pixels;
    int channels, height, width;
  } cases[] = {
      {"rgb.jpg", span_of(kPilRgbJpeg), span_of(kPilRgbJpegPixels), 3, 9, 13},
      {"progressive.jpg", span_of(kPilProgressiveJpeg), span_of(kPilProgressiveJpegPixels), 3, 9,
       13},
      {"grey.jpg", span_of(kPilGreyJpeg), span_of(kPilGreyJpegPixels), 1, 7, 11},
      {"cmyk.jpg", span_of(kPilCmykJpeg), span_of(kPilCmykJpegPixels), 3, 5, 6},
      {"3x1.jpg", span_of(kLibjpegSampling3x1Jpeg), span_of(kLibjpegSampling3x1JpegPixels), 3, 6,
       10},
  };
  for (const Case& c : cases) {
    const Array<uint8_t> decoded = decode_image(c.file, c.name);
    ASSERT_EQ(decoded.shape(), (std::vector<int64_t>{c.channels, c.height, c.width})) << c.name;
    // PIL links the same libjpeg-turbo, with the same DCT and upsampling, so
    // it agrees exactly; CMYK -> RGB and HWC -> CHW are conveyor's own.
    EXPECT_EQ(values_of(decoded), planar(c.pixels.data(), c.channels, c.height, c.width)) << c.name;
  }
}

// Compressed data past the image's end is refused, not inflated: a 1x1
// PNG of 16 KB holding 16 MiB of zeros after its pixel (1 GiB in 1 MB took
// libpng 4 s to inflate, only to warn of it). A little is still decoded.
TEST(PngDecode, CompressedDataPastTheImagesEndIsRefusedNotInflated) {
  const std::vector<uint8_t> bomb = one_pixel_png_with_trailing_data(size_t{16} << 20);
  ASSERT_LT(bomb.size(), size_t{64} << 10);
  try {
    (void)decode_image(bomb, "one-pixel.png");
    ADD_FAILURE() << "16 MiB of trailing image data was inflated";
  } catch (const conveyor::DataError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("one-pixel.png"), std::string::npos) << message;
    EXPECT_NE(message.find("more than a 1x1 image needs"), std::string::npos) << message;
  }
  const Array<uint8_t> pixel = decode_image(one_pixel_png_with_trailing_data(100), "one-pixel.png");
  ASSERT_EQ(pixel.shape(), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(pixel[0], 77);
}

TEST(PngDecode, AlphaIsDroppedAsPilDrops) {
  // Straight (not premultiplied) colour under every alpha, 0 included, as
  // PIL's convert("RGB") / convert("L") and torchvision's decode_png give it.
  struct Case {
    const char* name;
    std::span<const uint8_t> file;
    std::span<const uint8_t> pixels;
    int channels, height, width;
  } cases[] = {
      {"rgba.png", span_of(kPilRgbaPng), span_of(kPilRgbaPngPixels), 3, 4, 5},
      {"la.png", span_of(kPilGreyAlphaPng), span_of(kPilGreyAlphaPngPixels), 1, 3, 4},
      {"palette-trns.png", span_of(kPilTransparentPalettePng),
       span_of(kPilTransparentPalettePngPixels), 3, 2, 4},
  };
  for (const Case& c : cases) {
    const Array<uint8_t> decoded = decode_image(c.file, c.name);
    ASSERT_EQ(decoded.shape(), (std::vector<int64_t>{c.channels, c.height, c.width})) << c.name;
    EXPECT_EQ(values_of(decoded), planar(c.pixels.data(), c.channels, c.height, c.width)) << c.name;
  }
  // Converted on the way: RGBA -> grey is the luma of the colour alone.
  const Array<uint8_t> grey = decode_image(span_of(kPilRgbaPng), "rgba.png", 1);
  for (size_t i = 0; i < 20; ++i) {
    const uint8_t* rgb = kPilRgbaPngPixels + 3 * i;
    EXPECT_EQ(grey[i], luma(rgb[0], rgb[1], rgb[2])) << i;
  }
  const Array<uint8_t> la_as_rgb = decode_image(span_of(kPilGreyAlphaPng), "la.png", 3);
  for (size_t c = 0; c < 3; ++c) {
    EXPECT_TRUE(std::equal(kPilGreyAlphaPngPixels, kPilGreyAlphaPngPixels + 12,
                           la_as_rgb.values().begin() + static_cast<std::ptrdiff_t>(12 * c)));
  }
}

TEST(PngDecode, GammaChunkIsIgnored) {
  // Stored with gAMA 1.0: libpng alone would brighten 64 to 136; PIL and
  // torchvision return the stored samples.
  const Array<uint8_t> decoded = decode_image(span_of(kPilGamma1Png), "gamma.png");
  EXPECT_EQ(values_of(decoded), (std::vector<uint8_t>{0, 64, 128, 255}));
  // The usual gamma 1/2.2 is read as it is, without stripping the chunk.
  const Array<uint8_t> usual = decode_image(span_of(kPilGamma045Png), "gamma045.png");
  EXPECT_EQ(values_of(usual), (std::vector<uint8_t>{0, 64, 128, 255}));
}

TEST(PngDecode, SixteenBitIsScaledToEightBit) {
  const Array<uint8_t> decoded = decode_image(span_of(kPil16BitGreyPng), "16.png");
  ASSERT_EQ(decoded.shape(), (std::vector<int64_t>{1, 3, 5}));
  for (int y = 0; y < 3; ++y) {
    for (int x = 0; x < 5; ++x) {
      const int sixteen = x * 13107 + y * 257 * 3;
      // No gamma curve: 0 -> 0, 65535 -> 255, linear in between.
      EXPECT_NEAR(decoded[static_cast<size_t>(y * 5 + x)], sixteen / 257.0, 0.5 + 1e-9) << sixteen;
    }
  }
  // With alpha too, colour kept under alpha 0; round(v / 257), where PIL
  // truncates (v >> 8): at most 1 apart.
  const Array<uint8_t> rgba = decode_image(span_of(kHandmade16BitRgbaPng), "rgba16.png");
  ASSERT_EQ(rgba.shape(), (std::vector<int64_t>{3, 1, 4}));
  const int samples[4][3] = {
      {1000, 30000, 65535}, {65535, 25700, 0}, {12850, 15420, 17990}, {12345, 54321, 40000}};
  for (int x = 0; x < 4; ++x) {
    for (int c = 0; c < 3; ++c) {
      EXPECT_NEAR(rgba[static_cast<size_t>(c * 4 + x)], samples[x][c] / 257.0, 0.5 + 1e-9)
          << "x=" << x << " c=" << c;
    }
  }
}

// Our encoders' files, read back by PIL when it is installed.
TEST(ImageEncode, PilReadsWhatWeWrite) {
  if (std::system("/usr/bin/python3 -c 'import PIL' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "/usr/bin/python3 with PIL is not available";
  }
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("conveyor-image-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const Array<uint8_t> rgb = noise_image(3, 9, 13, 21);
  const Array<uint8_t> grey = noise_image(1, 7, 11, 22);
  const Array<uint8_t> smooth = smooth_image(3, 16, 24);
  struct Output {
    std::string file;
    std::vector<uint8_t> bytes;
    std::vector<uint8_t> expected;  // planar
  };
  const std::vector<uint8_t> rgb_jpeg = encode_jpeg(smooth, 90);
  const std::vector<uint8_t> grey_jpeg = encode_jpeg(grey, 90);
  const std::vector<Output> outputs = {
      {"rgb.png", encode_png(rgb), values_of(rgb)},
      {"grey.png", encode_png(grey), values_of(grey)},
      {"rgb.jpg", rgb_jpeg, values_of(decode_image(rgb_jpeg, "rgb.jpg"))},
      {"grey.jpg", grey_jpeg, values_of(decode_image(grey_jpeg, "grey.jpg"))},
  };
  std::string arguments;
  for (const Output& output : outputs) {
    std::ofstream(dir / output.file, std::ios::binary)
        .write(reinterpret_cast<const char*>(output.bytes.data()),
               static_cast<std::streamsize>(output.bytes.size()));
    arguments += " " + (dir / output.file).string();
  }
  // One line per file: channels height width hex(HWC pixels).
  const std::string command =
      "/usr/bin/python3 -c 'import sys; from PIL import Image\n"
      "for p in sys.argv[1:]:\n"
      "  i = Image.open(p); i.load()\n"
      "  print(len(i.getbands()), i.height, i.width, i.tobytes().hex())' " +
      arguments;
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string text;
  char chunk[4096];
  for (size_t got; (got = std::fread(chunk, 1, sizeof chunk, pipe)) > 0;) text.append(chunk, got);
  const int status = ::pclose(pipe);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(status, 0) << text;

  std::istringstream lines(text);
  for (const Output& output : outputs) {
    int channels = 0, height = 0, width = 0;
    std::string hex;
    ASSERT_TRUE(lines >> channels >> height >> width >> hex) << output.file;
    std::vector<uint8_t> interleaved(hex.size() / 2);
    for (size_t i = 0; i < interleaved.size(); ++i) {
      interleaved[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    }
    ASSERT_EQ(interleaved.size(), output.expected.size()) << output.file;
    const std::vector<uint8_t> pil = planar(interleaved.data(), channels, height, width);
    // PNG exactly; JPEG as our decoder reads it (same libjpeg-turbo).
    EXPECT_EQ(pil, output.expected) << output.file;
  }
}

// ---- errors ------------------------------------------------------------------------------

TEST(ImageErrors, EmptyInput) {
  const std::string message = decode_error({}, "shard-3/empty.jpg");
  EXPECT_NE(message.find("shard-3/empty.jpg"), std::string::npos) << message;
  EXPECT_NE(message.find("empty"), std::string::npos) << message;
  EXPECT_NE(info_error({}, "empty.png"), "");
}

TEST(ImageErrors, RandomBytes) {
  std::mt19937 engine(42);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<uint8_t> bytes(1 + engine() % 300);
    for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(engine());
    // Behind each magic too, so the real parsers see the garbage.
    for (const std::vector<uint8_t>& magic :
         {std::vector<uint8_t>{}, std::vector<uint8_t>{0xFF, 0xD8, 0xFF},
          std::vector<uint8_t>{0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'}}) {
      std::vector<uint8_t> input = magic;
      input.insert(input.end(), bytes.begin(), bytes.end());
      if (magic.empty() && sniff_image_format(input) != ImageFormat::unknown) continue;
      const std::string message = decode_error(input, "noise.bin");
      EXPECT_NE(message.find("noise.bin: "), std::string::npos) << trial << ": " << message;
    }
  }
}

TEST(JpegErrors, TruncatedInTheEntropyCodedData) {
  const Array<uint8_t> image = noise_image(3, 48, 64, 9);
  const std::vector<uint8_t> jpeg = encode_jpeg(image, 95);
  const size_t scan = jpeg_scan_start(jpeg);
  ASSERT_LT(scan + 1000, jpeg.size());
  const std::vector<uint8_t> cut(
      jpeg.begin(), jpeg.begin() + static_cast<std::ptrdiff_t>((scan + jpeg.size()) / 2));
  // The header is intact, so the size is known; the pixels are not.
  EXPECT_EQ(read_image_info(cut, "cut.jpg").width, 64);
  const std::string message = decode_error(cut, "cut.jpg");
  EXPECT_NE(message.find("cut.jpg: truncated or corrupt JPEG: "), std::string::npos) << message;
  EXPECT_NE(message.find("Premature end of JPEG file"), std::string::npos) << message;
  std::vector<uint8_t> slot(image.numel());
  EXPECT_THROW(decode_image_into(cut, slot, "cut.jpg"), DataError);

  // Missing only the end marker is still a truncated file.
  const std::vector<uint8_t> no_eoi(jpeg.begin(), jpeg.end() - 2);
  EXPECT_NE(decode_error(no_eoi, "no-eoi.jpg"), "");

  // Cut and closed with an end marker: the scan ends early ("premature end
  // of data segment"), which libjpeg would fill with grey.
  std::vector<uint8_t> closed = cut;
  closed.push_back(0xFF);
  closed.push_back(0xD9);
  const std::string closed_message = decode_error(closed, "closed.jpg");
  EXPECT_NE(closed_message.find("closed.jpg: truncated or corrupt JPEG: "), std::string::npos)
      << closed_message;

  // Cut inside the header.
  const std::vector<uint8_t> header_only(jpeg.begin(), jpeg.begin() + 40);
  EXPECT_NE(info_error(header_only, "header.jpg").find("header.jpg: unreadable JPEG header"),
            std::string::npos);
  EXPECT_NE(decode_error(header_only, "header.jpg"), "");
}

TEST(JpegErrors, CorruptEntropyCodedData) {
  const std::vector<uint8_t> jpeg = encode_jpeg(noise_image(3, 48, 64, 10), 95);
  const size_t scan = jpeg_scan_start(jpeg);
  // A restart marker in the middle of a scan that has none: libjpeg warns
  // and fills the rest with grey; conveyor refuses.
  std::vector<uint8_t> corrupt = jpeg;
  const size_t middle = (scan + jpeg.size()) / 2;
  corrupt[middle] = 0xFF;
  corrupt[middle + 1] = 0xD3;
  const std::string message = decode_error(corrupt, "rst.jpg");
  EXPECT_NE(message.find("rst.jpg: truncated or corrupt JPEG: Corrupt JPEG data"),
            std::string::npos)
      << message;
}

TEST(JpegDecode, ToleratesPaddingBeforeTheEndMarker) {
  const Array<uint8_t> image = noise_image(3, 16, 16, 12);
  const std::vector<uint8_t> jpeg = encode_jpeg(image, 90);
  std::vector<uint8_t> padded(jpeg.begin(), jpeg.end() - 2);
  padded.insert(padded.end(), 240, 0x00);  // "240 extraneous bytes before marker 0xd9"
  padded.push_back(0xFF);
  padded.push_back(0xD9);
  EXPECT_EQ(values_of(decode_image(padded, "padded.jpg")),
            values_of(decode_image(jpeg, "plain.jpg")));
}

TEST(JpegErrors, FailureDoesNotPoisonTheThreadsDecoder) {
  const Array<uint8_t> image = smooth_image(3, 8, 8);
  const std::vector<uint8_t> jpeg = encode_jpeg(image, 90);
  const std::vector<uint8_t> expected = values_of(decode_image(jpeg, "ok.jpg"));
  const std::vector<uint8_t> broken_header(jpeg.begin(), jpeg.begin() + 30);
  std::vector<uint8_t> cut(jpeg.begin(), jpeg.end() - 20);
  for (int round = 0; round < 3; ++round) {
    EXPECT_THROW(read_image_info(broken_header, "bad.jpg"), DataError);
    EXPECT_EQ(read_image_info(jpeg, "ok.jpg").width, 8);
    EXPECT_THROW(decode_image(broken_header, "bad.jpg"), DataError);
    EXPECT_EQ(values_of(decode_image(jpeg, "ok.jpg")), expected);
    EXPECT_THROW(decode_image(cut, "cut.jpg"), DataError);
    EXPECT_EQ(values_of(decode_image(jpeg, "ok.jpg")), expected);
  }
}

// `jpeg` without its marker segments of type `marker` before the first SOS.
std::vector<uint8_t> without_jpeg_segments(const std::vector<uint8_t>& jpeg, uint8_t marker) {
  std::vector<uint8_t> out(jpeg.begin(), jpeg.begin() + 2);  // SOI
  size_t at = 2;
  while (at + 4 <= jpeg.size() && jpeg[at] == 0xFF && jpeg[at + 1] != 0xDA) {
    const size_t end = at + 2 + (size_t{jpeg[at + 2]} << 8 | jpeg[at + 3]);
    if (jpeg[at + 1] != marker) {
      out.insert(out.end(), jpeg.begin() + static_cast<std::ptrdiff_t>(at),
                 jpeg.begin() + static_cast<std::ptrdiff_t>(end));
    }
    at = end;
  }
  out.insert(out.end(), jpeg.begin() + static_cast<std::ptrdiff_t>(at), jpeg.end());
  return out;
}

// What decode_image makes of `bytes`: its pixels, or its error message.
using DecodeOutcome = std::pair<std::vector<uint8_t>, std::string>;

DecodeOutcome decode_outcome(std::span<const uint8_t> bytes, const std::string& name) {
  try {
    return {values_of(decode_image(bytes, name)), ""};
  } catch (const DataError& error) {
    return {{}, error.what()};
  }
}

// The same on a thread that has decoded nothing before.
DecodeOutcome decode_on_a_new_thread(std::span<const uint8_t> bytes, const std::string& name) {
  DecodeOutcome outcome;
  std::thread([&] { outcome = decode_outcome(bytes, name); }).join();
  return outcome;
}

// libjpeg keeps the tables of the images a handle has read. Before the fix a
// JPEG without its own DQT failed on a new worker thread but decoded, with
// the previous image's quantization, on a thread that had read a JPEG.
TEST(JpegErrors, MissingTablesFailTheSameAfterAnotherDecode) {
  const std::vector<uint8_t> jpeg = encode_jpeg(smooth_image(3, 16, 16), 90);
  const std::vector<uint8_t> no_dqt = without_jpeg_segments(jpeg, 0xDB);
  ASSERT_LT(no_dqt.size(), jpeg.size());
  const std::string fresh_error = decode_on_a_new_thread(no_dqt, "no-dqt.jpg").second;
  EXPECT_NE(fresh_error.find("no-dqt.jpg: cannot decode JPEG: "), std::string::npos) << fresh_error;
  const DecodeOutcome whole = decode_on_a_new_thread(jpeg, "with-tables.jpg");
  ASSERT_EQ(whole.second, "");
  std::thread([&] {
    EXPECT_EQ(decode_outcome(jpeg, "with-tables.jpg"), whole);
    EXPECT_EQ(decode_outcome(no_dqt, "no-dqt.jpg"), (DecodeOutcome{{}, fresh_error}));
    // read_image_info needs no table, so it reads the header either way.
    EXPECT_EQ(read_image_info(no_dqt, "no-dqt.jpg").width, 16);
    EXPECT_EQ(decode_outcome(no_dqt, "no-dqt.jpg"), (DecodeOutcome{{}, fresh_error}));
    // And the thread's own handle still decodes a whole file.
    EXPECT_EQ(decode_outcome(jpeg, "with-tables.jpg"), whole);
  }).join();
}

// Without DHT, a sequential JPEG decodes with libjpeg's standard Huffman
// tables (those TurboJPEG encodes with), not with the optimized ones a
// progressive file left in the handle; before the fix it failed after one.
TEST(JpegDecode, MissingHuffmanTablesAreTheStandardOnesAfterAnotherDecode) {
  const Array<uint8_t> image = noise_image(3, 16, 16, 18);
  const std::vector<uint8_t> jpeg = encode_jpeg(image, 90);
  const std::vector<uint8_t> no_dht = without_jpeg_segments(jpeg, 0xC4);
  ASSERT_LT(no_dht.size(), jpeg.size());
  const DecodeOutcome expected = {values_of(decode_image(jpeg, "with-tables.jpg")), ""};
  EXPECT_EQ(decode_on_a_new_thread(no_dht, "no-dht.jpg"), expected);
  const DecodeOutcome progressive = {planar(kPilProgressiveJpegPixels, 3, 9, 13), ""};
  std::thread([&] {
    // PIL's progressive files have optimized tables, defined before each scan.
    EXPECT_EQ(decode_outcome(span_of(kPilProgressiveJpeg), "progressive.jpg"), progressive);
    EXPECT_EQ(decode_outcome(no_dht, "no-dht.jpg"), expected);
    EXPECT_EQ(decode_outcome(span_of(kPilProgressiveJpeg), "progressive.jpg"), progressive);
  }).join();
}

TEST(PngErrors, Truncated) {
  const std::vector<uint8_t> png = encode_png(noise_image(3, 20, 20, 13));
  const auto [idat, idat_length] = png_chunk(png, "IDAT");
  ASSERT_GT(idat_length, 100u);
  const std::vector<uint8_t> cut(png.begin(),
                                 png.begin() + static_cast<std::ptrdiff_t>(idat + idat_length / 2));
  EXPECT_EQ(read_image_info(cut, "cut.png").width, 20);  // the header is whole
  const std::string message = decode_error(cut, "cut.png");
  EXPECT_NE(message.find("cut.png: corrupt PNG data: "), std::string::npos) << message;
  // Cut inside IHDR.
  const std::vector<uint8_t> header(png.begin(), png.begin() + 20);
  EXPECT_NE(info_error(header, "header.png").find("header.png: unreadable PNG header"),
            std::string::npos);
  // Without IEND every pixel is still there: read, as PIL reads it.
  const std::vector<uint8_t> no_end(png.begin(), png.end() - 12);
  EXPECT_EQ(values_of(decode_image(no_end, "no-end.png")), values_of(decode_image(png, "png")));
}

TEST(PngErrors, BadCrc) {
  const std::vector<uint8_t> png = encode_png(noise_image(1, 10, 10, 14));
  const auto [idat, idat_length] = png_chunk(png, "IDAT");
  // A flipped bit in the pixel data: zlib's checksum over the whole stream
  // catches it before libpng reaches the chunk's CRC.
  std::vector<uint8_t> corrupt_data = png;
  corrupt_data[idat + idat_length / 2] ^= 0x10;
  const std::string data_message = decode_error(corrupt_data, "data.png");
  EXPECT_NE(data_message.find("data.png: corrupt PNG data: "), std::string::npos) << data_message;
  // Intact data under a wrong CRC.
  std::vector<uint8_t> corrupt_crc = png;
  corrupt_crc[idat + idat_length + 1] ^= 0x10;
  const std::string message = decode_error(corrupt_crc, "crc.png");
  EXPECT_NE(message.find("crc.png: corrupt PNG data: "), std::string::npos) << message;
  EXPECT_NE(message.find("CRC"), std::string::npos) << message;
  // A wrong CRC on the header chunk fails already at read_image_info.
  std::vector<uint8_t> corrupt_header = png;
  const auto [ihdr, ihdr_length] = png_chunk(png, "IHDR");
  corrupt_header[ihdr + ihdr_length] ^= 0x01;
  EXPECT_NE(info_error(corrupt_header, "ihdr.png").find("ihdr.png: "), std::string::npos);
}

TEST(ImageErrors, WrongOutSize) {
  const std::vector<uint8_t> png = encode_png(smooth_image(3, 5, 7));
  std::vector<uint8_t> small(104);
  try {
    decode_image_into(png, small, "slot.png");
    ADD_FAILURE() << "no ValueError";
  } catch (const ValueError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("105"), std::string::npos) << message;  // expected
    EXPECT_NE(message.find("104"), std::string::npos) << message;  // actual
    EXPECT_NE(message.find("slot.png"), std::string::npos) << message;
  }
  std::vector<uint8_t> grey_size(35);
  EXPECT_THROW(decode_image_into(png, grey_size, "slot.png"), ValueError);
  EXPECT_EQ(decode_image_into(png, grey_size, "slot.png", 1).channels, 1);
  std::vector<uint8_t> rgb_size(105);
  EXPECT_THROW(decode_image_into(encode_jpeg(smooth_image(1, 5, 7)), rgb_size, "g.jpg"),
               ValueError);
  EXPECT_EQ(decode_image_into(encode_jpeg(smooth_image(1, 5, 7)), rgb_size, "g.jpg", 3).channels,
            3);
}

TEST(ImageErrors, BadArguments) {
  const std::vector<uint8_t> png = encode_png(smooth_image(3, 5, 7));
  EXPECT_THROW(decode_image(png, "x.png", 2), ValueError);
  EXPECT_THROW(decode_image(png, "x.png", 4), ValueError);
  EXPECT_THROW(decode_image({}, "x.png", -1), ValueError);  // checked before the bytes
  EXPECT_THROW(encode_png(Array<uint8_t>({2, 4, 4})), ValueError);
  EXPECT_THROW(encode_png(Array<uint8_t>({4, 4})), ValueError);
  EXPECT_THROW(encode_png(Array<uint8_t>({3, 0, 4})), ValueError);
  EXPECT_THROW(encode_jpeg(Array<uint8_t>({1, 2, 3, 4})), ValueError);
  EXPECT_THROW(encode_jpeg(Array<uint8_t>({3, 70000, 1})), ValueError);
  EXPECT_THROW(encode_jpeg(smooth_image(3, 4, 4), 0), ValueError);
  EXPECT_THROW(encode_jpeg(smooth_image(3, 4, 4), 101), ValueError);
  EXPECT_THROW(encode_png(Array<uint8_t>()), ValueError);
}

// ---- decompression bombs (13) -------------------------------------------------------

// Before the fix decode_image sized its output by the header: 4.8 GB for this
// 800-byte file (std::bad_alloc under the cap: the child exited 2), and
// decode_image_into complained of `out`'s size, a ValueError.
TEST(ImageBombs, TinyJpegClaimingFortyThousandSquaredIsRefusedFromItsHeader) {
  const std::vector<uint8_t> jpeg = jpeg_claiming(40000, 40000);
  ASSERT_LT(jpeg.size(), 1000u);
  const ImageInfo info = read_image_info(jpeg, "bomb.jpg");  // the header alone is fine
  EXPECT_EQ(info.width, 40000);
  EXPECT_EQ(info.height, 40000);
  const std::vector<std::string> parts = {
      "bomb.jpg: image of 40000 x 40000 = 1600000000 pixels is over the limit of 178956970 "
      "pixels"};
  EXPECT_EXIT(exit_zero_on_data_error_under_cap([&] { decode_image(jpeg, "bomb.jpg"); }, parts),
              ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(exit_zero_on_data_error_under_cap([&] { decode_image(jpeg, "bomb.jpg", 1); }, parts),
              ::testing::ExitedWithCode(0), "");
  // Into caller memory: refused before `out`'s size is even looked at.
  std::vector<uint8_t> slot(16);
  EXPECT_THROW(decode_image_into(jpeg, slot, "bomb.jpg"), DataError);
}

// Before the fix: std::bad_alloc from a 3 TB allocation, which names no file
// and which OnError::skip does not skip (the child exited 2).
TEST(ImageBombs, SixtyNineBytePngClaimingAMillionSquaredIsRefusedFromItsHeader) {
  const std::vector<uint8_t> png = png_claiming(1000000, 1000000);
  EXPECT_EQ(png.size(), 69u);
  EXPECT_EQ(read_image_info(png, "bomb.png").width, 1000000);
  const std::vector<std::string> parts = {
      "bomb.png: image of 1000000 x 1000000 = 1000000000000 pixels is over the limit"};
  EXPECT_EXIT(exit_zero_on_data_error_under_cap([&] { decode_image(png, "bomb.png"); }, parts),
              ::testing::ExitedWithCode(0), "");
  std::vector<uint8_t> slot(16);
  EXPECT_THROW(decode_image_into(png, slot, "bomb.png"), DataError);
}

// With the limit lifted, running out of memory is still a DataError naming
// the image, which OnError::skip can skip, and not a std::bad_alloc.
TEST(ImageBombs, OutOfMemoryIsADataErrorNamingTheImage) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer ends the process on a failed allocation instead of "
                  "throwing std::bad_alloc";
#endif
  const std::vector<uint8_t> png = png_claiming(1000000, 1000000);
  EXPECT_EXIT(exit_zero_on_data_error_under_cap(
                  [&] {
                    set_max_image_pixels(0);  // in the child only
                    decode_image(png, "huge.png");
                  },
                  {"huge.png: out of memory decoding the image"}),
              ::testing::ExitedWithCode(0), "");
}

// A CMYK JPEG (TurboJPEG writes YCCK) of `width` x `height` in one flat
// colour.
std::vector<uint8_t> flat_cmyk_jpeg(int width, int height) {
  std::vector<uint8_t> cmyk(4 * static_cast<size_t>(width) * static_cast<size_t>(height));
  for (size_t i = 0; i < cmyk.size(); i += 4) {
    cmyk[i] = 30, cmyk[i + 1] = 90, cmyk[i + 2] = 150, cmyk[i + 3] = 210;
  }
  tjhandle encoder = tjInitCompress();
  unsigned char* jpeg = nullptr;
  unsigned long size = 0;
  const int rc = tjCompress2(encoder, cmyk.data(), width, 0, height, TJPF_CMYK, &jpeg, &size,
                             TJSAMP_444, 90, 0);
  EXPECT_EQ(rc, 0) << tjGetErrorStr2(encoder);
  std::vector<uint8_t> bytes(jpeg, jpeg + size);
  tjFree(jpeg);
  tjDestroy(encoder);
  return bytes;
}

// A CMYK JPEG decodes through one scratch buffer of 4 bytes a pixel beside
// its output: the child may grow its address space by that and 16 MiB more.
// Before, it also allocated 3 bytes a pixel of RGB (64 + 48 MiB here).
TEST(ImageBombs, CmykJpegDecodesInFourBytesAPixelOfScratch) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer ends the process on a failed allocation instead of "
                  "throwing std::bad_alloc";
#endif
  constexpr int kSide = 4096;
  constexpr uint64_t kPixels = uint64_t{kSide} * kSide;
  EXPECT_EXIT(
      {
        const std::vector<uint8_t> jpeg = flat_cmyk_jpeg(kSide, kSide);
        std::vector<uint8_t> out(3 * kPixels);
        rlimit limit{};
        getrlimit(RLIMIT_AS, &limit);
        limit.rlim_cur = std::min<uint64_t>(conveyor::testing::address_space_bytes() + 4 * kPixels +
                                                (uint64_t{16} << 20),
                                            limit.rlim_max);
        if (setrlimit(RLIMIT_AS, &limit) != 0) std::_Exit(3);
        try {
          const ImageInfo info = decode_image_into(jpeg, out, "cmyk.jpg");
          if (info.channels != 3) std::_Exit(4);
          // PIL's inverted CMYK: 210 - (255 - c) * 210 / 255 for c = 30, 90,
          // 150 is 25, 74, 124; YCCK's round trip may move a sample by one.
          const auto near = [](int got, int want) { return std::abs(got - want) <= 2; };
          if (!near(out.front(), 25) || !near(out[kPixels], 74) || !near(out.back(), 124)) {
            std::fprintf(stderr, "pixels %d %d %d\n", out.front(), out[kPixels], out.back());
            std::_Exit(5);
          }
        } catch (const std::exception& error) {
          std::fprintf(stderr, "%s\n", error.what());
          std::_Exit(1);
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

// zlib's compress() of `bytes`, as zTXt and iTXt store text.
std::vector<uint8_t> zlib_compressed(const std::vector<uint8_t>& bytes) {
  uLongf size = compressBound(static_cast<uLong>(bytes.size()));
  std::vector<uint8_t> compressed(size);
  EXPECT_EQ(compress2(compressed.data(), &size, bytes.data(), static_cast<uLong>(bytes.size()), 9),
            Z_OK);
  compressed.resize(size);
  return compressed;
}

// `png` with `chunks` (type, data) inserted right after IHDR.
std::vector<uint8_t> with_chunks_after_header(
    const std::vector<uint8_t>& png,
    const std::vector<std::pair<const char*, std::vector<uint8_t>>>& chunks) {
  const auto [ihdr, ihdr_length] = png_chunk(png, "IHDR");
  const auto after_ihdr = png.begin() + static_cast<std::ptrdiff_t>(ihdr + ihdr_length + 4);
  std::vector<uint8_t> out(png.begin(), after_ihdr);
  for (const auto& [type, data] : chunks) append_png_chunk(out, type, data);
  out.insert(out.end(), after_ihdr, png.end());
  return out;
}

// ru_maxrss in bytes.
uint64_t peak_resident_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;
}

// Before the fix libpng inflated every zTXt and iTXt chunk before IDAT and
// kept it until the end of the decode: these 50 chunks, 8 KB each in the
// file, held 50 x 7.9 MB.
TEST(ImageBombs, TextChunksBeforeIdatDoNotCostMemory) {
  const std::vector<uint8_t> text = zlib_compressed(std::vector<uint8_t>(7'900'000, 'a'));
  std::vector<std::pair<const char*, std::vector<uint8_t>>> chunks;
  for (int i = 0; i < 50; ++i) {
    const std::string keyword = "key" + std::to_string(i);
    std::vector<uint8_t> data(keyword.begin(), keyword.end());
    if (i % 2 == 0) {  // zTXt: keyword, 0, method 0, zlib data
      data.insert(data.end(), {0, 0});
    } else {  // iTXt: keyword, 0, compressed, method 0, no language, no translated keyword
      data.insert(data.end(), {0, 1, 0, 0, 0});
    }
    data.insert(data.end(), text.begin(), text.end());
    chunks.emplace_back(i % 2 == 0 ? "zTXt" : "iTXt", std::move(data));
  }
  const Array<uint8_t> pixel = make_image(1, 1, 1, [](int64_t, int64_t, int64_t) { return 77; });
  const std::vector<uint8_t> png = with_chunks_after_header(encode_png(pixel), chunks);
  ASSERT_LT(png.size(), 1'000'000u);
  EXPECT_EXIT(exit_zero_if_under_cap([&]() -> std::string {
                const uint64_t peak_before = peak_resident_bytes();
                const Array<uint8_t> decoded = decode_image(png, "text.png");
                const uint64_t growth = peak_resident_bytes() - peak_before;
                if (values_of(decoded) != std::vector<uint8_t>{77}) return "wrong pixel";
                if (growth >= uint64_t{64} << 20) {
                  return "the decode raised the peak resident size by " +
                         std::to_string(growth >> 20) + " MiB";
                }
                return "";
              }),
              ::testing::ExitedWithCode(0), "");
}

// What the decode no longer reads (text, physical size, time, a private
// chunk) never changed the pixels; the chunks libpng uses for them stay.
TEST(PngDecode, AncillaryChunksBeforeIdatLeaveThePixels) {
  const std::vector<uint8_t> png = encode_png(noise_image(3, 5, 4, 17));
  const std::vector<uint8_t> expected = values_of(decode_image(png, "plain.png"));
  const std::vector<uint8_t> latin1 = {'T', 'i', 't', 'l', 'e', 0, 'x'};
  std::vector<uint8_t> compressed_text = {'C', 'o', 'm', 'm', 'e', 'n', 't', 0, 0};
  const std::vector<uint8_t> comment = zlib_compressed({'h', 'i'});
  compressed_text.insert(compressed_text.end(), comment.begin(), comment.end());
  const std::vector<uint8_t> decorated = with_chunks_after_header(
      png, {{"tEXt", latin1},
            {"zTXt", compressed_text},
            {"pHYs", {0, 0, 11, 19, 0, 0, 11, 19, 1}},
            {"tIME", {7, 232, 1, 2, 3, 4, 5}},
            {"prVt", {1, 2, 3}},
            {"gAMA", {0, 0, 0xB1, 0x8F}}});  // 1/2.2, kept
  ASSERT_GT(decorated.size(), png.size());
  EXPECT_EQ(values_of(decode_image(decorated, "decorated.png")), expected);
}

TEST(ImagePixelLimit, DefaultIsPillowsErrorThreshold) {
  EXPECT_EQ(kDefaultMaxImagePixels, 2u * 89'478'485u);  // 2 * Image.MAX_IMAGE_PIXELS
  EXPECT_EQ(max_image_pixels(), kDefaultMaxImagePixels);
}

TEST(ImagePixelLimit, JustUnderDecodesJustOverIsRefused) {
  const Array<uint8_t> image = smooth_image(3, 30, 40);  // 1200 pixels
  for (const std::vector<uint8_t>& encoded : {encode_png(image), encode_jpeg(image, 90)}) {
    std::vector<uint8_t> slot(3 * 1200);
    {
      ScopedMaxImagePixels limit(1200);
      EXPECT_EQ(decode_image(encoded, "at.img").shape(), (std::vector<int64_t>{3, 30, 40}));
      EXPECT_EQ(decode_image_into(encoded, slot, "at.img").width, 40);
    }
    {
      ScopedMaxImagePixels limit(1199);
      const std::string message = decode_error(encoded, "over.img");
      EXPECT_NE(message.find("over.img: image of 40 x 30 = 1200 pixels is over the limit of "
                             "1199 pixels"),
                std::string::npos)
          << message;
      EXPECT_THROW(decode_image_into(encoded, slot, "over.img"), DataError);
      EXPECT_EQ(read_image_info(encoded, "over.img").width, 40);  // headers are still read
    }
    {
      ScopedMaxImagePixels no_limit(0);
      EXPECT_EQ(max_image_pixels(), 0u);
      EXPECT_EQ(decode_image(encoded, "any.img").shape(), (std::vector<int64_t>{3, 30, 40}));
    }
    EXPECT_EQ(max_image_pixels(), kDefaultMaxImagePixels);
  }
}

// Process-wide, as Pillow's: set on one thread, it holds on every other.
TEST(ImagePixelLimit, SetOnOneThreadHoldsOnAll) {
  const std::vector<uint8_t> png = encode_png(smooth_image(1, 10, 10));
  ScopedMaxImagePixels limit(99);
  bool refused = false;
  std::thread other([&] {
    try {
      decode_image(png, "other-thread.png");
    } catch (const DataError&) {
      refused = true;
    }
  });
  other.join();
  EXPECT_TRUE(refused);
}

// A member of a container: the file and the member are named apart.
TEST(ImagePixelLimit, ErrorNamesFileAndMemberApart) {
  const std::vector<uint8_t> png = encode_png(smooth_image(1, 10, 10));
  ScopedMaxImagePixels limit(99);
  try {
    decode_image(png, "shard-7.tar", "000123", 0);
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& error) {
    EXPECT_EQ(error.file(), "shard-7.tar");
    EXPECT_EQ(error.member(), "000123");
    EXPECT_NE(std::string(error.what()).find("shard-7.tar, member '000123': image of 10 x 10"),
              std::string::npos)
        << error.what();
  }
}

// Decoders are called from many workers at once; each thread keeps its own
// TurboJPEG handle.
TEST(ImageThreads, ConcurrentDecodesAgree) {
  const std::vector<uint8_t> jpeg = encode_jpeg(noise_image(3, 32, 32, 15), 90);
  const std::vector<uint8_t> png = encode_png(noise_image(3, 32, 32, 16));
  const std::vector<uint8_t> cut(jpeg.begin(), jpeg.end() - 100);
  const std::vector<uint8_t> jpeg_pixels = values_of(decode_image(jpeg, "a.jpg"));
  const std::vector<uint8_t> png_pixels = values_of(decode_image(png, "a.png"));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        if (values_of(decode_image(jpeg, "a.jpg")) != jpeg_pixels) ++mismatches;
        if (values_of(decode_image(png, "a.png")) != png_pixels) ++mismatches;
        try {
          decode_image(cut, "cut.jpg");
          ++mismatches;
        } catch (const DataError&) {
        }
        if (encode_png(decode_image(png, "a.png")) != png) ++mismatches;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace conveyor
