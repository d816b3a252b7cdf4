# cmake -DFILE=<java source> -P package_private.cmake
# Turns "public interface" / "public class" at the top level of a SWIG-generated Java file into package-private.
file(READ "${FILE}" text)
string(REGEX REPLACE "\npublic (interface|class|final class) " "\n\\1 " text "${text}")
file(WRITE "${FILE}" "${text}")
