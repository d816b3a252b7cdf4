package org.kvret;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.FloatBuffer;
import java.nio.IntBuffer;
import java.util.Arrays;

/**
 * A view of memory that kvret reads or writes: a direct {@link ByteBuffer} in native byte order (or a raw device
 * address), an element type, a shape and optional strides in elements. It crosses into kvret without a copy.
 *
 * <p>Buffer-backed tensors are bounds-checked when they are made, so kvret never reads or writes past the buffer.
 */
public final class Tensor {
  // Read by the JNI layer (kvret_java.i): keep names and types in step with it.
  final ByteBuffer buffer;
  final long address;
  final long byteOffset;
  final int dtypeCode;
  final int dtypeBits;
  final int deviceType;
  final int deviceId;
  final long[] shape;
  final long[] strides;

  private final DType dtype;

  private Tensor(ByteBuffer buffer, long address, long byteOffset, DType dtype, DeviceType device, int deviceId,
      long[] shape, long[] strides) {
    this.buffer = buffer;
    this.address = address;
    this.byteOffset = byteOffset;
    this.dtype = dtype;
    this.dtypeCode = dtype.code;
    this.dtypeBits = dtype.bits;
    this.deviceType = device.code;
    this.deviceId = deviceId;
    this.shape = shape.clone();
    this.strides = strides == null ? null : strides.clone();
    for (long extent : shape) {
      if (extent < 0) {
        throw new IllegalArgumentException("kvret: negative extent in shape " + Arrays.toString(shape));
      }
    }
    if (strides != null && strides.length != shape.length) {
      throw new IllegalArgumentException("kvret: strides and shape differ in length");
    }
    if (buffer != null) {
      checkBounds();
    }
  }

  /** A new zeroed tensor in a direct, native-order buffer. */
  public static Tensor allocate(DType dtype, long... shape) {
    long bytes = elementCount(shape) * dtype.bytes();
    if (bytes > Integer.MAX_VALUE) {
      throw new IllegalArgumentException("kvret: a tensor of " + bytes + " bytes does not fit one ByteBuffer");
    }
    ByteBuffer buffer = ByteBuffer.allocateDirect((int) bytes).order(ByteOrder.nativeOrder());
    return new Tensor(buffer, 0, 0, dtype, DeviceType.CPU, 0, shape, null);
  }

  /**
   * A row-major tensor over {@code buffer} from its position on; the buffer must be direct and in native order
   * (allocate it with {@code ByteBuffer.allocateDirect(n).order(ByteOrder.nativeOrder())}).
   */
  public static Tensor wrap(ByteBuffer buffer, DType dtype, long... shape) {
    if (!buffer.isDirect()) {
      throw new IllegalArgumentException("kvret: a tensor needs a direct ByteBuffer");
    }
    if (buffer.order() != ByteOrder.nativeOrder()) {
      throw new IllegalArgumentException("kvret: a tensor's ByteBuffer must be in native byte order");
    }
    return new Tensor(buffer, 0, buffer.position(), dtype, DeviceType.CPU, 0, shape, null);
  }

  /** A new F32 tensor holding a copy of {@code values}. */
  public static Tensor ofFloats(float[] values, long... shape) {
    Tensor tensor = allocate(DType.F32, shape);
    if (values.length != tensor.elementCount()) {
      throw new IllegalArgumentException("kvret: " + values.length + " values for shape " + Arrays.toString(shape));
    }
    tensor.buffer.asFloatBuffer().put(values);
    return tensor;
  }

  /** A new I32 tensor holding a copy of {@code values}. */
  public static Tensor ofInts(int[] values, long... shape) {
    Tensor tensor = allocate(DType.I32, shape);
    if (values.length != tensor.elementCount()) {
      throw new IllegalArgumentException("kvret: " + values.length + " values for shape " + Arrays.toString(shape));
    }
    tensor.buffer.asIntBuffer().put(values);
    return tensor;
  }

  /** A row-major tensor at a raw address (e.g. CUDA memory from another library). Not bounds-checked. */
  public static Tensor ofAddress(long address, DType dtype, DeviceType device, int deviceId, long... shape) {
    return new Tensor(null, address, 0, dtype, device, deviceId, shape, null);
  }

  /** The same memory seen through other strides (in elements; the innermost must be 1 for kvret). */
  public Tensor withStrides(long... strides) {
    return new Tensor(buffer, address, byteOffset, dtype, DeviceType.fromCode(deviceType), deviceId, shape, strides);
  }

  public DType dtype() {
    return dtype;
  }

  public DeviceType device() {
    return DeviceType.fromCode(deviceType);
  }

  public long[] shape() {
    return shape.clone();
  }

  public long shape(int dim) {
    return shape[dim];
  }

  /** The strides in elements, or null for compact row-major. */
  public long[] strides() {
    return strides == null ? null : strides.clone();
  }

  public long elementCount() {
    return elementCount(shape);
  }

  /** The buffer (a duplicate positioned at the tensor's first byte, native order), or null for a raw address. */
  public ByteBuffer buffer() {
    if (buffer == null) {
      return null;
    }
    ByteBuffer view = buffer.duplicate().order(ByteOrder.nativeOrder());
    view.position((int) byteOffset);
    return view;
  }

  /** An F32 tensor's buffer as floats, from its first element. */
  public FloatBuffer asFloatBuffer() {
    requireDtype(DType.F32);
    return buffer().asFloatBuffer();
  }

  /** An I32 tensor's buffer as ints, from its first element. */
  public IntBuffer asIntBuffer() {
    requireDtype(DType.I32);
    return buffer().asIntBuffer();
  }

  /** The F32 element at {@code index} (one index per dimension). */
  public float getFloat(long... index) {
    requireDtype(DType.F32);
    return buffer.getFloat(byteIndex(index));
  }

  /** The I32 element at {@code index} (one index per dimension). */
  public int getInt(long... index) {
    requireDtype(DType.I32);
    return buffer.getInt(byteIndex(index));
  }

  /** A row-major copy of an F32 tensor's elements. */
  public float[] toFloatArray() {
    requireDtype(DType.F32);
    float[] values = new float[Math.toIntExact(elementCount())];
    long[] index = new long[shape.length];
    for (int i = 0; i < values.length; ++i) {
      values[i] = buffer.getFloat(byteIndex(index));
      increment(index);
    }
    return values;
  }

  /** A row-major copy of an I32 tensor's elements. */
  public int[] toIntArray() {
    requireDtype(DType.I32);
    int[] values = new int[Math.toIntExact(elementCount())];
    long[] index = new long[shape.length];
    for (int i = 0; i < values.length; ++i) {
      values[i] = buffer.getInt(byteIndex(index));
      increment(index);
    }
    return values;
  }

  @Override
  public String toString() {
    return "Tensor(" + dtype + " " + Arrays.toString(shape)
        + (strides == null ? "" : " strides " + Arrays.toString(strides)) + " on " + device() + ")";
  }

  boolean writable() {
    return buffer == null || !buffer.isReadOnly();
  }

  private long stride(int dim) {
    if (strides != null) {
      return strides[dim];
    }
    long stride = 1;
    for (int i = dim + 1; i < shape.length; ++i) {
      stride *= shape[i];
    }
    return stride;
  }

  private int byteIndex(long[] index) {
    if (buffer == null) {
      throw new IllegalStateException("kvret: a raw-address tensor cannot be read from Java");
    }
    if (index.length != shape.length) {
      throw new IllegalArgumentException("kvret: " + index.length + " indices for " + shape.length + " dimensions");
    }
    long element = 0;
    for (int i = 0; i < index.length; ++i) {
      if (index[i] < 0 || index[i] >= shape[i]) {
        throw new IndexOutOfBoundsException(
            "kvret: index " + Arrays.toString(index) + " outside " + Arrays.toString(shape));
      }
      element += index[i] * stride(i);
    }
    return Math.toIntExact(byteOffset + element * dtype.bytes());
  }

  private void increment(long[] index) {
    for (int i = index.length - 1; i >= 0; --i) {
      if (++index[i] < shape[i]) {
        return;
      }
      index[i] = 0;
    }
  }

  private void checkBounds() {
    if (elementCount() == 0) {
      return;
    }
    long last = 0;
    for (int i = 0; i < shape.length; ++i) {
      long stride = stride(i);
      if (stride < 0) {
        throw new IllegalArgumentException("kvret: negative strides are not supported");
      }
      last += (shape[i] - 1) * stride;
    }
    long needed = byteOffset + (last + 1) * dtype.bytes();
    if (needed > buffer.capacity()) {
      throw new IllegalArgumentException(
          "kvret: " + this + " needs " + needed + " bytes, the buffer has " + buffer.capacity());
    }
  }

  private void requireDtype(DType expected) {
    if (dtype != expected) {
      throw new IllegalStateException("kvret: this is a " + dtype + " tensor, not " + expected);
    }
  }

  private static long elementCount(long[] shape) {
    long count = 1;
    for (long extent : shape) {
      count = Math.multiplyExact(count, extent);
    }
    return count;
  }
}
