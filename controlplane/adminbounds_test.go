package controlplane

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
)

const testBootstrap = "controlplane-test-bootstrap-token-0123456789"

// startControlPlane runs a control plane on a fresh database until the
// test ends.
func startControlPlane(t *testing.T, mut func(*Config)) *ControlPlane {
	t.Helper()
	cfg := Config{DatabaseURL: testsvc.NewDatabase(t), AdminAddr: "127.0.0.1:0", KeyPepper: pepper, KEK: kek,
		NATSURL: testsvc.StartNATS(t).URL, BootstrapToken: testBootstrap}
	if mut != nil {
		mut(&cfg)
	}
	cp, err := New(context.Background(), cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cp.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("control plane did not stop")
		}
	})
	return cp
}

// rssBytes reads one size field ("VmRSS", "VmHWM") of this process from
// /proc/self/status: the control plane runs in the test process.
func rssBytes(t *testing.T, field string) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	require.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatalf("no %s in /proc/self/status", field)
	return 0
}

// bigBody describes a request whose body a generator streams: nothing of
// its size is ever allocated.
type bigBody struct {
	contentType string
	auth        string // bearer token, "" for none
	chunked     bool   // no Content-Length (Transfer-Encoding: chunked)
	size        int64
}

// sendBig sends a CreateOrg request over a raw HTTP/1.1 connection,
// streaming the body from a generator while it reads the answer. It
// returns the answer's HTTP status and Connect error, how long the answer
// took and how many body bytes the client managed to write (what the
// kernel's socket buffers took plus what the server read).
func sendBig(t *testing.T, addr string, b bigBody) (status int, cerr connectErr, took time.Duration, written int64) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	var head bytes.Buffer
	fmt.Fprintf(&head, "POST /sluice.admin.v1.OrgService/CreateOrg HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\n", addr, b.contentType)
	if b.auth != "" {
		fmt.Fprintf(&head, "Authorization: Bearer %s\r\n", b.auth)
	}
	if b.chunked {
		head.WriteString("Transfer-Encoding: chunked\r\n\r\n")
	} else {
		fmt.Fprintf(&head, "Content-Length: %d\r\n\r\n", b.size)
	}
	start := time.Now()
	_, err = conn.Write(head.Bytes())
	require.NoError(t, err)

	var sent atomic.Int64
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		// A JSON string (or, for protobuf, field 1 of CreateOrgRequest
		// with a huge length) followed by filler: the server would have
		// to read all of it to decode anything.
		chunk := bytes.Repeat([]byte("a"), 64<<10)
		var prefix []byte
		if strings.Contains(b.contentType, "json") {
			prefix = []byte(`{"name":"`)
		} else {
			prefix = binary.AppendUvarint([]byte{0x0a}, uint64(b.size)) // field 1 (name), length-delimited
		}
		write := func(p []byte) bool {
			if b.chunked {
				if _, err := fmt.Fprintf(conn, "%x\r\n", len(p)); err != nil {
					return false
				}
			}
			n, err := conn.Write(p)
			sent.Add(int64(n))
			if err != nil {
				return false
			}
			if b.chunked {
				if _, err := conn.Write([]byte("\r\n")); err != nil {
					return false
				}
			}
			return true
		}
		if !write(prefix) {
			return
		}
		for left := b.size - int64(len(prefix)); left > 0; {
			p := chunk
			if int64(len(p)) > left {
				p = p[:left]
			}
			if !write(p) {
				return
			}
			left -= int64(len(p))
		}
	}()

	require.NoError(t, conn.SetReadDeadline(time.Now().Add(60*time.Second)))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err, "the server answers before the body is sent")
	took = time.Since(start)
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	require.NoError(t, json.Unmarshal(body, &cerr), "a Connect error: %s", body)
	// Stop the writer (its next write fails) and count what it sent.
	_ = conn.Close()
	<-writerDone
	return resp.StatusCode, cerr, took, sent.Load()
}

type connectErr struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// TestAdminRefusesHugeBodiesBeforeReadingThem sends 300 MB CreateOrg
// bodies over HTTP/1.1, Connect JSON and binary protobuf, declared and
// chunked, without and with a token: each is refused at once, without
// the control plane reading more than its limit, and its memory stays
// where it was. Not parallel: the RSS figures are the process's.
func TestAdminRefusesHugeBodiesBeforeReadingThem(t *testing.T) {
	cp := startControlPlane(t, nil)
	const size = 300 << 20
	// Warm up (first connections, pools) before the memory baseline.
	st, ce, _, _ := sendBig(t, cp.Addr(), bigBody{contentType: "application/json", size: 10})
	require.Equal(t, http.StatusUnauthorized, st, ce)
	rssBefore, hwmBefore := rssBytes(t, "VmRSS"), rssBytes(t, "VmHWM")

	limit := fmt.Sprint(DefaultAdminMaxRequestBytes)
	for _, tc := range []struct {
		name     string
		body     bigBody
		code     string
		contains string
		// maxWritten bounds what the client could write: socket buffers
		// (a few MB on loopback) plus what the server is allowed to read.
		maxWritten int64
	}{
		{"unauthenticated json, declared", bigBody{contentType: "application/json", size: size}, "resource_exhausted", limit, 48 << 20},
		{"unauthenticated proto, declared", bigBody{contentType: "application/proto", size: size}, "resource_exhausted", limit, 48 << 20},
		{"unauthenticated json, chunked", bigBody{contentType: "application/json", chunked: true, size: size}, "unauthenticated", "bearer token", 48 << 20},
		{"unauthenticated proto, chunked", bigBody{contentType: "application/proto", chunked: true, size: size}, "unauthenticated", "bearer token", 48 << 20},
		{"bad token, chunked", bigBody{contentType: "application/json", auth: "sat_not-a-real-token", chunked: true, size: size}, "unauthenticated", "admin token", 48 << 20},
		{"authenticated json, declared", bigBody{contentType: "application/json", auth: testBootstrap, size: size}, "resource_exhausted", limit, 48 << 20},
		// Authenticated and without a length: read up to the limit, then cut.
		{"authenticated json, chunked", bigBody{contentType: "application/json", auth: testBootstrap, chunked: true, size: size}, "resource_exhausted", limit, 56 << 20},
		{"authenticated proto, chunked", bigBody{contentType: "application/proto", auth: testBootstrap, chunked: true, size: size}, "resource_exhausted", limit, 56 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, cerr, took, written := sendBig(t, cp.Addr(), tc.body)
			t.Logf("status %d, %s: %s; answered in %v after %d body bytes", status, cerr.Code, cerr.Message, took, written)
			require.Equal(t, tc.code, cerr.Code, cerr.Message)
			require.Contains(t, cerr.Message, tc.contains)
			require.Less(t, written, tc.maxWritten, "the client could write only what socket buffers hold (and the limit)")
			require.Less(t, took, 20*time.Second, "answered without waiting for the body")
		})
	}
	rssAfter, hwmAfter := rssBytes(t, "VmRSS"), rssBytes(t, "VmHWM")
	t.Logf("RSS %d MB -> %d MB, peak %d MB -> %d MB", rssBefore>>20, rssAfter>>20, hwmBefore>>20, hwmAfter>>20)
	// Generous margins (the race detector multiplies the few MiB the
	// limit allows): reading the bodies took it to 1.8 GB.
	require.Less(t, rssAfter-rssBefore, int64(256<<20), "control-plane memory unchanged (2.4 GB of bodies were sent)")
	require.Less(t, hwmAfter-hwmBefore, int64(256<<20), "and it never peaked")

	// The listener still serves.
	st, ce, _, _ = sendBig(t, cp.Addr(), bigBody{contentType: "application/json", size: 10})
	require.Equal(t, http.StatusUnauthorized, st, ce)
}

// TestAdminCutsTricklingBodies: a body that trickles in is cut off at the
// read timeout instead of holding the connection.
func TestAdminCutsTricklingBodies(t *testing.T) {
	t.Parallel()
	cp := startControlPlane(t, func(c *Config) { c.AdminReadTimeout = 2 * time.Second })
	conn, err := net.Dial("tcp", cp.Addr())
	require.NoError(t, err)
	defer conn.Close()
	start := time.Now()
	_, err = fmt.Fprintf(conn, "POST /sluice.admin.v1.OrgService/CreateOrg HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+
		"Authorization: Bearer %s\r\nContent-Length: 1000\r\n\r\n{\"name\":\"", testBootstrap)
	require.NoError(t, err)
	// Hold the rest back. The server must give up on its own: the read
	// below returns (an answer or the connection closing) well before
	// its own deadline.
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(60*time.Second)))
	_, err = io.Copy(io.Discard, conn)
	var ne net.Error
	if err != nil && errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the server held a trickling body for %v", time.Since(start))
	}
	took := time.Since(start)
	t.Logf("connection ended after %v (%v)", took, err)
	require.GreaterOrEqual(t, took, 1500*time.Millisecond, "not before the read timeout")
	require.Less(t, took, 30*time.Second)
}
