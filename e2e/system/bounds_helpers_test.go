package system

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane"

	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// boundsRig is a control plane, one vLLM simulator behind model group
// "qwen", a tenant and a data plane configured by opts.
type boundsRig struct {
	d   *dist
	p   *proxy
	ten tenant
}

func startBoundsRig(t *testing.T, opts ...func(*dataplane.Config)) *boundsRig {
	t.Helper()
	d := startDist(t)
	sim := startSim(t)
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "qwen", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "qwen", ApiBase: sim.URL() + "/v1",
		UpstreamModel: vllmsim.DefaultModel, Weight: 1, Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
	require.NoError(t, err)
	ten := d.NewTenant("bounds")
	p := d.StartProxy("default", time.Minute, opts...)
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("qwen")) == 1 }, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)
	return &boundsRig{d: d, p: p, ten: ten}
}

// chat sends one small chat completion and returns its status.
func (r *boundsRig) chat(t testing.TB) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, r.p.URL+"/v1/chat/completions",
		strings.NewReader(`{"model":"qwen","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+r.ten.Token)
	req.Close = true // its own connection, gone afterwards
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// promValue reads the series of name with exactly labels from g (0 when
// absent).
func promValue(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue next
				}
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

// rssBytes is the process's resident set (VmRSS).
func rssBytes(t testing.TB) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	require.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmRSS in /proc/self/status")
	return 0
}

// rawRequest writes the head of a POST to path on c, declaring
// contentLength, with the bearer tok when set.
func rawRequest(t testing.TB, c net.Conn, path, tok string, contentLength int) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "POST %s HTTP/1.1\r\nHost: sluice\r\nContent-Type: application/json\r\nContent-Length: %d\r\n", path, contentLength)
	if tok != "" {
		fmt.Fprintf(&b, "Authorization: Bearer %s\r\n", tok)
	}
	b.WriteString("\r\n")
	_, err := io.WriteString(c, b.String())
	require.NoError(t, err)
}

// rawAnswer is an answer read from a raw connection.
type rawAnswer struct {
	status int
	code   string
	hdr    http.Header
	// closed: the server closed the connection after the answer.
	closed bool
}

// readRawAnswer reads one answer from br (within d) and whether the
// connection ends after it.
func readRawAnswer(t testing.TB, c net.Conn, br *bufio.Reader, d time.Duration) rawAnswer {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(d)))
	resp, err := http.ReadResponse(br, nil)
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	_ = resp.Body.Close()
	a := rawAnswer{status: resp.StatusCode, hdr: resp.Header, code: errorCode(b)}
	if resp.Close {
		// A reset is a close too: bytes the client kept sending after
		// the answer (a trickling body) make the kernel answer the
		// server's close with RST instead of FIN.
		_, err := br.ReadByte()
		a.closed = err == io.EOF || errors.Is(err, syscall.ECONNRESET)
	}
	return a
}

func errorCode(b []byte) string {
	var e struct {
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	_ = json.Unmarshal(b, &e)
	return e.Error.Code
}

// h2Client speaks h2c (prior knowledge) frame by frame on one connection,
// so a test can open streams, send partial bodies and end them early as a
// hostile client would.
type h2Client struct {
	t    testing.TB
	c    net.Conn
	host string

	wmu    sync.Mutex
	fr     *http2.Framer
	enc    *hpack.Encoder
	encBuf bytes.Buffer
	next   uint32

	mu       sync.Mutex
	streams  map[uint32]*h2Stream
	settings chan struct{}
	goAway   *http2.GoAwayFrame
	readErr  error
}

// h2Stream is what the server answered on one stream.
type h2Stream struct {
	status int
	body   bytes.Buffer
	// rst is the RST_STREAM code the server sent, if any.
	rst *http2.ErrCode
	// done: the answer is complete (END_STREAM) or the stream was reset.
	done bool
}

func dialH2(t testing.TB, addr string) *h2Client {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	h := &h2Client{t: t, c: c, host: addr, next: 1, streams: map[uint32]*h2Stream{}, settings: make(chan struct{})}
	h.fr = http2.NewFramer(c, c)
	h.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	h.enc = hpack.NewEncoder(&h.encBuf)
	_, err = io.WriteString(c, http2.ClientPreface)
	require.NoError(t, err)
	// Large windows: answers are never held up by flow control.
	require.NoError(t, h.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20}))
	require.NoError(t, h.fr.WriteWindowUpdate(0, 1<<20))
	go h.read()
	select {
	case <-h.settings:
	case <-time.After(10 * time.Second):
		t.Fatal("no SETTINGS from the server")
	}
	return h
}

func (h *h2Client) read() {
	var once sync.Once
	for {
		f, err := h.fr.ReadFrame()
		if err != nil {
			h.mu.Lock()
			h.readErr = err
			h.mu.Unlock()
			return
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				h.wmu.Lock()
				_ = h.fr.WriteSettingsAck()
				h.wmu.Unlock()
				once.Do(func() { close(h.settings) })
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				h.wmu.Lock()
				_ = h.fr.WritePing(true, f.Data)
				h.wmu.Unlock()
			}
		case *http2.GoAwayFrame:
			h.mu.Lock()
			h.goAway = f
			h.mu.Unlock()
		case *http2.MetaHeadersFrame:
			h.mu.Lock()
			st := h.stream(f.StreamID)
			if s, err := strconv.Atoi(f.PseudoValue("status")); err == nil && st.status == 0 {
				st.status = s
			}
			st.done = st.done || f.StreamEnded()
			h.mu.Unlock()
		case *http2.DataFrame:
			h.mu.Lock()
			st := h.stream(f.StreamID)
			st.body.Write(f.Data())
			st.done = st.done || f.StreamEnded()
			h.mu.Unlock()
		case *http2.RSTStreamFrame:
			h.mu.Lock()
			st := h.stream(f.StreamID)
			code := f.ErrCode
			st.rst, st.done = &code, true
			h.mu.Unlock()
		}
	}
}

// stream returns the state of stream id (h.mu held).
func (h *h2Client) stream(id uint32) *h2Stream {
	st := h.streams[id]
	if st == nil {
		st = &h2Stream{}
		h.streams[id] = st
	}
	return st
}

// open starts a POST to path declaring contentLength and sends first as
// its first DATA frame, ending the stream when end is set.
func (h *h2Client) open(path, tok string, contentLength int, first []byte, end bool) uint32 {
	h.t.Helper()
	h.wmu.Lock()
	defer h.wmu.Unlock()
	id := h.next
	h.next += 2
	h.encBuf.Reset()
	for _, kv := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":authority", h.host}, {":path", path},
		{"content-type", "application/json"}, {"content-length", strconv.Itoa(contentLength)}} {
		require.NoError(h.t, h.enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]}))
	}
	if tok != "" {
		require.NoError(h.t, h.enc.WriteField(hpack.HeaderField{Name: "authorization", Value: "Bearer " + tok}))
	}
	require.NoError(h.t, h.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: h.encBuf.Bytes(), EndHeaders: true,
		EndStream: len(first) == 0 && end}))
	if len(first) > 0 || end {
		require.NoError(h.t, h.fr.WriteData(id, end, first))
	}
	return id
}

// answer waits until stream id is answered (within d) and returns its
// status and error code (0 and the RST code's name when it was reset
// before an answer).
func (h *h2Client) answer(id uint32, d time.Duration) (int, string) {
	h.t.Helper()
	deadline := time.Now().Add(d)
	for {
		h.mu.Lock()
		st, err := h.streams[id], h.readErr
		if st != nil && st.done {
			status, code := st.status, errorCode(st.body.Bytes())
			if status == 0 && st.rst != nil {
				code = st.rst.String()
			}
			h.mu.Unlock()
			return status, code
		}
		h.mu.Unlock()
		if err != nil {
			h.t.Fatalf("h2c connection failed before stream %d was answered: %v", id, err)
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("stream %d not answered within %s", id, d)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// answered reports whether stream id has an answer or a reset yet.
func (h *h2Client) answered(id uint32) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := h.streams[id]
	return st != nil && st.done
}
