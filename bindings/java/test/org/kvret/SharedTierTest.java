package org.kvret;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;

import java.io.File;
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Random;
import org.junit.After;
import org.junit.Assume;
import org.junit.Before;
import org.junit.Test;

/** The shared session tier: two contexts on one redis-server (started per test; skipped where none is installed). */
public class SharedTierTest {
  private final Random random = new Random(21);
  private Process server;
  private Path dir;
  private String url;

  private static String findServer() {
    for (String entry : System.getenv().getOrDefault("PATH", "").split(File.pathSeparator)) {
      File candidate = new File(entry, "redis-server");
      if (candidate.canExecute()) {
        return candidate.getPath();
      }
    }
    return null;
  }

  @Before
  public void startServer() throws Exception {
    String executable = findServer();
    Assume.assumeTrue("redis-server is not installed", executable != null);
    int port;
    try (ServerSocket probe = new ServerSocket(0)) {
      port = probe.getLocalPort();
    }
    dir = Files.createTempDirectory("kvret-redis");
    server = new ProcessBuilder(executable, "--port", String.valueOf(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", dir.toString())
        .redirectErrorStream(true)
        .redirectOutput(ProcessBuilder.Redirect.DISCARD)
        .start();
    long deadline = System.nanoTime() + 10_000_000_000L;
    while (true) {
      try (Socket socket = new Socket()) {
        socket.connect(new InetSocketAddress("127.0.0.1", port), 200);
        break;
      } catch (java.io.IOException e) {
        Assume.assumeTrue("redis-server did not start", System.nanoTime() < deadline && server.isAlive());
        Thread.sleep(50);
      }
    }
    url = "redis://127.0.0.1:" + port + "/0?prefix=kvret-java-" + port;
  }

  @After
  public void stopServer() throws Exception {
    if (server != null) {
      server.destroy();
      server.waitFor();
    }
    if (dir != null) {
      try (var files = Files.walk(dir)) {
        files.sorted((a, b) -> b.compareTo(a)).forEach(p -> p.toFile().delete());
      }
    }
  }

  @Test
  public void anotherContextOpensWhatOneSaved() {
    Config config = Fixtures.config().sessionSharedUrl(url).build();
    try (Context a = Context.create(config); Context b = Context.create(config); Sequence seq = a.openSequence()) {
      assertEquals(url, a.config().sessionSharedUrl());
      for (int layer = 0; layer < Fixtures.LAYERS; ++layer) {
        seq.appendPrefill(layer, Fixtures.kv(random), Fixtures.kv(random));
      }
      seq.saveSession("shared-1");
      a.flushSessions();
      assertEquals(SessionTier.SHARED, b.sessionTier("shared-1"));
      try (Sequence reopened = b.openSession("shared-1").orElseThrow()) {
        for (int layer = 0; layer < Fixtures.LAYERS; ++layer) {
          assertEquals(Fixtures.TOKENS, reopened.length(layer));
          Tensor k1 = Tensor.allocate(DType.F32, Fixtures.TOKENS, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
          Tensor v1 = Tensor.allocate(DType.F32, Fixtures.TOKENS, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
          Tensor k2 = Tensor.allocate(DType.F32, Fixtures.TOKENS, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
          Tensor v2 = Tensor.allocate(DType.F32, Fixtures.TOKENS, Fixtures.KV_HEADS, Fixtures.HEAD_DIM);
          seq.read(layer, 0, Fixtures.TOKENS, k1, v1);
          reopened.read(layer, 0, Fixtures.TOKENS, k2, v2);
          assertArrayEquals(k1.toFloatArray(), k2.toFloatArray(), 0f);
          assertArrayEquals(v1.toFloatArray(), v2.toFloatArray(), 0f);
        }
      }
      assertFalse(b.openSession("never-saved").isPresent());
      assertTrue(b.dropSession("shared-1"));
      assertEquals(SessionTier.NONE, b.sessionTier("shared-1"));
    }
  }

  @Test
  public void malformedUrlsAreRefusedByName() {
    for (String bad : new String[] {"http://127.0.0.1:6379", "redis://127.0.0.1:99999", "redis://"}) {
      Config config = Fixtures.config().sessionSharedUrl(bad).build();
      KvretException e = org.junit.Assert.assertThrows(KvretException.class, () -> Context.create(config));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertTrue(e.getMessage(), e.getMessage().contains("session_shared_url"));
    }
  }
}
