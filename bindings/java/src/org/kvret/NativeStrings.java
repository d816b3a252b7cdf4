package org.kvret;

import java.nio.ByteBuffer;
import java.nio.CharBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;

/** Strings for the native calls: UTF-8 bytes without a NUL (JNI's own conversion is modified UTF-8). */
final class NativeStrings {
  private NativeStrings() {}

  /**
   * The UTF-8 bytes of {@code value}.
   *
   * @throws NullPointerException if value is null
   * @throws KvretException status INVALID_ARGUMENT if it holds a NUL character or an unpaired surrogate
   */
  static byte[] utf8(String value, String name) {
    if (value == null) {
      throw new NullPointerException("kvret: " + name + " is null");
    }
    if (value.indexOf('\0') >= 0) {
      throw new KvretException(Status.INVALID_ARGUMENT.code(), name + " contains a NUL character");
    }
    try {
      ByteBuffer encoded = StandardCharsets.UTF_8.newEncoder()
          .onMalformedInput(CodingErrorAction.REPORT)
          .onUnmappableCharacter(CodingErrorAction.REPORT)
          .encode(CharBuffer.wrap(value));
      byte[] bytes = new byte[encoded.remaining()];
      encoded.get(bytes);
      return bytes;
    } catch (CharacterCodingException e) {
      throw new KvretException(
          Status.INVALID_ARGUMENT.code(), name + " cannot be encoded as UTF-8 (an unpaired surrogate)");
    }
  }

  /** {@link #utf8}, or null for null. */
  static byte[] utf8OrNull(String value, String name) {
    return value == null ? null : utf8(value, name);
  }

  /** The string of UTF-8 bytes the library gave, or null for null. */
  static String fromUtf8(byte[] bytes) {
    return bytes == null ? null : new String(bytes, StandardCharsets.UTF_8);
  }
}
