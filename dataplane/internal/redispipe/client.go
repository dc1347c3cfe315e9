// Package redispipe is the Redis client of the limits hot path: a few
// connections shared by every caller, with automatic pipelining. A call
// appends its command to its connection's write buffer and wakes the
// connection's writer, which first yields to the goroutines that are
// ready to run (they may be about to queue commands too) and then writes
// everything queued in one system call; one reader per connection matches
// the replies to the callers in order. Under load many commands share one
// write and one read; an idle client pays one goroutine switch.
//
// Why not go-redis for this path: a go-redis call takes a pooled
// connection, checks its health with a system call, writes, and reads its
// reply on the caller's goroutine: three to four system calls per command
// whatever the load. Measured on the limits overhead benchmark
// (docs/limits.md), that was most of the data plane's added CPU per
// limited request. Here concurrent requests share the write and the read
// system calls. go-redis is still used for Redis Cluster (slot routing) and
// everywhere off the request path.
//
// The client speaks RESP2 and only what the limiter needs: commands whose
// arguments are strings and integers, and integer, string, nil, error and
// array replies.
package redispipe

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of Options.
const (
	DefaultDialTimeout = 250 * time.Millisecond
	DefaultConns       = 1
	// DefaultStaleAfter is how long the oldest unanswered command of a
	// connection may wait before the connection is considered dead and
	// replaced (a frozen server, a half-open TCP connection). Callers do
	// not wait that long: each call ends at its own context deadline.
	DefaultStaleAfter = time.Second
	// DefaultAbortSilentAfter is how long a connection must have been
	// silent (no reply at all) before a call that gives up aborts it.
	DefaultAbortSilentAfter = 100 * time.Millisecond
	readBufSize             = 32 << 10
	// maxSpare bounds the write buffer kept between writes.
	maxSpare = 256 << 10
)

// Options configure a Client.
type Options struct {
	Network  string // "tcp" (default) or "unix"
	Addr     string
	Username string
	Password string
	DB       int
	// TLSConfig enables TLS when non-nil.
	TLSConfig   *tls.Config
	DialTimeout time.Duration
	// Conns is the number of connections (each with its own reader);
	// calls are spread over them round robin.
	Conns      int
	StaleAfter time.Duration
	// AbortSilentAfter: a call that gives up (its context ended) aborts
	// its connection when no reply at all arrived on it since the call was
	// queued and for at least this long (a frozen server); otherwise the
	// call is only abandoned, so a busy client whose reader ran late does
	// not fail every call in flight.
	AbortSilentAfter time.Duration
}

var (
	// ErrClosed is returned by calls on a closed Client.
	ErrClosed = errors.New("redispipe: client closed")
)

// DialError reports that no connection could be made or set up (dial,
// TLS, AUTH, SELECT), or that the call's context had ended before it was
// sent: the call's command was never sent.
type DialError struct{ Err error }

func (e *DialError) Error() string { return "redispipe: connect: " + e.Err.Error() }
func (e *DialError) Unwrap() error { return e.Err }

// ConnError reports that a call's connection broke, or that the call's
// context ended, after its command was queued for sending: the command may
// or may not have run.
type ConnError struct{ Err error }

func (e *ConnError) Error() string { return "redispipe: " + e.Err.Error() }
func (e *ConnError) Unwrap() error { return e.Err }

// Client is safe for concurrent use.
type Client struct {
	opts   Options
	slots  []*slot
	rr     atomic.Uint32
	closed atomic.Bool
	stats  stats
}

type stats struct {
	writes, commands, dials atomic.Int64
}

// Stats are counters since the Client was made.
type Stats struct {
	Writes   int64 // write system calls
	Commands int64 // commands queued
	Dials    int64 // connections made
}

// Stats returns the client's counters; Commands ÷ Writes is the mean
// number of commands that shared a write.
func (c *Client) Stats() Stats {
	return Stats{Writes: c.stats.writes.Load(), Commands: c.stats.commands.Load(), Dials: c.stats.dials.Load()}
}

// slot holds one connection, replaced when it breaks.
type slot struct {
	dialing chan struct{} // one dial at a time
	cur     atomic.Pointer[conn]
}

// New validates opts and returns a Client. Connections are made on first
// use (and again after one breaks).
func New(opts Options) (*Client, error) {
	if opts.Network == "" {
		opts.Network = "tcp"
	}
	if opts.Network != "tcp" && opts.Network != "unix" {
		return nil, fmt.Errorf("redispipe: network %q: want tcp or unix", opts.Network)
	}
	if opts.Addr == "" {
		return nil, errors.New("redispipe: address is required")
	}
	if opts.DB < 0 {
		return nil, fmt.Errorf("redispipe: database %d must not be negative", opts.DB)
	}
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = DefaultDialTimeout
	}
	if opts.StaleAfter <= 0 {
		opts.StaleAfter = DefaultStaleAfter
	}
	if opts.AbortSilentAfter <= 0 {
		opts.AbortSilentAfter = DefaultAbortSilentAfter
	}
	switch {
	case opts.Conns == 0:
		opts.Conns = DefaultConns
	case opts.Conns < 0 || opts.Conns > 64:
		return nil, fmt.Errorf("redispipe: %d connections: want 1–64", opts.Conns)
	}
	c := &Client{opts: opts, slots: make([]*slot, opts.Conns)}
	for i := range c.slots {
		c.slots[i] = &slot{dialing: make(chan struct{}, 1)}
	}
	return c, nil
}

// Close closes every connection; calls in flight fail with a ConnError.
func (c *Client) Close() error {
	if !c.closed.CompareAndSwap(false, true) {
		return nil
	}
	for _, s := range c.slots {
		if cn := s.cur.Load(); cn != nil {
			cn.fail(ErrClosed)
		}
	}
	return nil
}

// Cmd is one command: Head (command name and leading arguments), then
// Keys, then Args (string, []byte, int, int64, int32, uint32 or bool),
// then RawN arguments already encoded as RESP bulk strings in Raw
// (AppendBulk, AppendBulkInt: no boxing on hot paths). Raw is copied when
// the command is queued.
type Cmd struct {
	Head []string
	Keys []string
	Args []any
	Raw  []byte
	RawN int
}

// Do runs one command.
func (c *Client) Do(ctx context.Context, args ...any) (Value, error) {
	return c.do(ctx, Cmd{Args: args})
}

// EvalSha runs EVALSHA sha with keys and the rawN arguments encoded in raw.
func (c *Client) EvalSha(ctx context.Context, sha string, keys []string, raw []byte, rawN int) (Value, error) {
	return c.do(ctx, EvalShaCmd(sha, keys, raw, rawN))
}

// Eval runs EVAL src with keys and the rawN arguments encoded in raw (it
// also loads the script, so later EVALSHA calls find it).
func (c *Client) Eval(ctx context.Context, src string, keys []string, raw []byte, rawN int) (Value, error) {
	return c.do(ctx, Cmd{Head: []string{"EVAL", src, strconv.Itoa(len(keys))}, Keys: keys, Raw: raw, RawN: rawN})
}

// EvalShaCmd builds the Cmd of an EVALSHA, for DoMulti.
func EvalShaCmd(sha string, keys []string, raw []byte, rawN int) Cmd {
	return Cmd{Head: []string{"EVALSHA", sha, strconv.Itoa(len(keys))}, Keys: keys, Raw: raw, RawN: rawN}
}

func (c *Client) do(ctx context.Context, cmd Cmd) (Value, error) {
	cl := getCall()
	cn, err := c.send(ctx, []*call{cl}, func(b []byte) ([]byte, error) {
		return appendCommand(b, cmd.Head, cmd.Keys, cmd.Args, cmd.Raw, cmd.RawN)
	})
	if err != nil {
		putCall(cl)
		return Value{}, err
	}
	return cn.wait(ctx, cl)
}

// DoMulti runs cmds in order on one connection, written together.
// Results and errors are per command.
func (c *Client) DoMulti(ctx context.Context, cmds []Cmd) ([]Value, []error) {
	vals := make([]Value, len(cmds))
	errs := make([]error, len(cmds))
	if len(cmds) == 0 {
		return vals, errs
	}
	cls := make([]*call, len(cmds))
	for i := range cls {
		cls[i] = getCall()
	}
	cn, err := c.send(ctx, cls, func(b []byte) ([]byte, error) {
		var err error
		for _, cmd := range cmds {
			if b, err = appendCommand(b, cmd.Head, cmd.Keys, cmd.Args, cmd.Raw, cmd.RawN); err != nil {
				return b, err
			}
		}
		return b, nil
	})
	if err != nil {
		for i := range errs {
			errs[i] = err
			putCall(cls[i])
		}
		return vals, errs
	}
	for i, cl := range cls {
		vals[i], errs[i] = cn.wait(ctx, cl)
	}
	return vals, errs
}

// send queues the calls' commands (enc appends them) on a live
// connection and starts writing them. An error means nothing was sent.
func (c *Client) send(ctx context.Context, cls []*call, enc func([]byte) ([]byte, error)) (*conn, error) {
	if c.closed.Load() {
		return nil, ErrClosed
	}
	// A call whose context already ended is not sent: on a live connection
	// its reply could otherwise win the race with ctx.Done in wait, and a
	// caller past its deadline would get an answer it no longer waits for.
	if err := ctx.Err(); err != nil {
		return nil, &DialError{Err: fmt.Errorf("not sent: %w", err)}
	}
	s := c.slots[0]
	if len(c.slots) > 1 {
		s = c.slots[c.rr.Add(1)%uint32(len(c.slots))]
	}
	// A connection found broken while queueing sent nothing: take the
	// next one (bounded: each attempt dials at most once).
	for attempt := 0; ; attempt++ {
		cn, err := c.conn(ctx, s)
		if err != nil {
			return nil, err
		}
		ok, err := cn.enqueue(c.opts.StaleAfter, cls, enc)
		if err != nil {
			return nil, err
		}
		if ok {
			return cn, nil
		}
		if attempt == 2 {
			return nil, &DialError{Err: errors.New("connections keep breaking")}
		}
	}
}

// conn returns s's live connection, dialing one when there is none.
func (c *Client) conn(ctx context.Context, s *slot) (*conn, error) {
	if cn := s.cur.Load(); cn != nil && !cn.broken.Load() {
		return cn, nil
	}
	select {
	case s.dialing <- struct{}{}:
	case <-ctx.Done():
		return nil, &DialError{Err: ctx.Err()}
	}
	defer func() { <-s.dialing }()
	if cn := s.cur.Load(); cn != nil && !cn.broken.Load() {
		return cn, nil
	}
	if c.closed.Load() {
		return nil, ErrClosed
	}
	cn, err := c.dial(ctx)
	if err != nil {
		return nil, &DialError{Err: err}
	}
	if old := s.cur.Swap(cn); old != nil {
		old.fail(errors.New("connection replaced"))
	}
	if c.closed.Load() {
		cn.fail(ErrClosed)
		return nil, ErrClosed
	}
	return cn, nil
}

// dial connects and sets the connection up (TLS, AUTH, SELECT) within
// DialTimeout and ctx.
func (c *Client) dial(ctx context.Context) (*conn, error) {
	ctx, cancel := context.WithTimeout(ctx, c.opts.DialTimeout)
	defer cancel()
	d := net.Dialer{KeepAlive: 15 * time.Second}
	nc, err := d.DialContext(ctx, c.opts.Network, c.opts.Addr)
	if err != nil {
		return nil, err
	}
	if c.opts.TLSConfig != nil {
		cfg := c.opts.TLSConfig.Clone()
		if cfg.ServerName == "" && c.opts.Network == "tcp" {
			if host, _, err := net.SplitHostPort(c.opts.Addr); err == nil {
				cfg.ServerName = host
			}
		}
		tc := tls.Client(nc, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			_ = nc.Close()
			return nil, fmt.Errorf("tls: %w", err)
		}
		nc = tc
	}
	br := bufio.NewReaderSize(nc, readBufSize)
	if err := c.setup(ctx, nc, br); err != nil {
		_ = nc.Close()
		return nil, err
	}
	cn := &conn{nc: nc, br: br, wake: make(chan struct{}, 1), dead: make(chan struct{}), stats: &c.stats,
		abortSilent: int64(c.opts.AbortSilentAfter), lastReply: time.Now().UnixNano()}
	c.stats.dials.Add(1)
	go cn.readLoop()
	go cn.writeLoop(c.opts.StaleAfter)
	return cn, nil
}

// setup authenticates and selects the database on a new connection.
func (c *Client) setup(ctx context.Context, nc net.Conn, br *bufio.Reader) error {
	var cmds [][]any
	if c.opts.Password != "" {
		if c.opts.Username != "" {
			cmds = append(cmds, []any{"AUTH", c.opts.Username, c.opts.Password})
		} else {
			cmds = append(cmds, []any{"AUTH", c.opts.Password})
		}
	}
	if c.opts.DB != 0 {
		cmds = append(cmds, []any{"SELECT", c.opts.DB})
	}
	if len(cmds) == 0 {
		return nil
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = nc.SetDeadline(dl)
		defer func() { _ = nc.SetDeadline(time.Time{}) }()
	}
	var b []byte
	for _, cmd := range cmds {
		var err error
		if b, err = appendCommand(b, nil, nil, cmd, nil, 0); err != nil {
			return err
		}
	}
	if _, err := nc.Write(b); err != nil {
		return err
	}
	for _, cmd := range cmds {
		if _, err := readValue(br, 0); err != nil {
			return fmt.Errorf("%s: %w", cmd[0], err)
		}
	}
	return nil
}

// call is one command awaiting its reply.
type call struct {
	v    Value
	err  error
	at   int64         // when it was queued (Unix ns)
	seen uint64        // the connection's replies when it was queued
	done chan struct{} // receives once, when v/err are set
}

var callPool = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

func getCall() *call { return callPool.Get().(*call) }

// putCall recycles a call whose reply was received (never an abandoned
// one: its reader may still write to it).
func putCall(cl *call) {
	cl.v, cl.err = Value{}, nil
	callPool.Put(cl)
}

// conn is one connection: a write buffer that callers fill and flush, a
// FIFO of calls awaiting replies, and a reader goroutine.
type conn struct {
	nc net.Conn
	br *bufio.Reader

	stats       *stats
	abortSilent int64         // Options.AbortSilentAfter, ns
	wake        chan struct{} // the writer has something to write (1-buffered)
	dead        chan struct{} // closed when the connection breaks

	mu        sync.Mutex
	wbuf      []byte  // queued commands, not yet written
	writing   bool    // the writer is between taking wbuf and writing it
	q         []*call // awaiting replies, oldest at qhead
	qhead     int
	replies   uint64 // replies received
	lastReply int64  // when the last reply (or the connection) came, Unix ns
	err       error
	broken    atomic.Bool
}

// enqueue appends the calls' commands and wakes the writer. ok is false
// when the connection is broken, or found stale (its oldest unanswered
// command waited longer than stale: a frozen server or a half-open
// connection, which new calls must not queue behind); nothing was queued
// then. err reports an encoding error (nothing was queued).
func (cn *conn) enqueue(stale time.Duration, cls []*call, enc func([]byte) ([]byte, error)) (ok bool, err error) {
	now := time.Now().UnixNano()
	cn.mu.Lock()
	if cn.err != nil {
		cn.mu.Unlock()
		return false, nil
	}
	if cn.qhead < len(cn.q) && now-cn.q[cn.qhead].at > int64(stale) {
		cn.mu.Unlock()
		cn.abort(&ConnError{Err: fmt.Errorf("no reply for %v", stale)})
		return false, nil
	}
	n := len(cn.wbuf)
	b, err := enc(cn.wbuf)
	if err != nil {
		cn.wbuf = b[:n]
		cn.mu.Unlock()
		return false, err
	}
	cn.wbuf = b
	for _, cl := range cls {
		cl.at, cl.seen = now, cn.replies
	}
	cn.q = append(cn.q, cls...)
	wake := n == 0 && !cn.writing
	cn.mu.Unlock()
	cn.stats.commands.Add(int64(len(cls)))
	if wake {
		select {
		case cn.wake <- struct{}{}:
		default:
		}
	}
	return true, nil
}

// writeLoop writes what callers queue. Before each write it yields once,
// so that goroutines already runnable (other requests about to queue
// their commands) go first and share the write. A write that cannot
// complete within writeTimeout (a server that stopped reading) breaks the
// connection.
func (cn *conn) writeLoop(writeTimeout time.Duration) {
	var spare []byte
	for {
		select {
		case <-cn.wake:
		case <-cn.dead:
			return
		}
		for {
			runtime.Gosched()
			cn.mu.Lock()
			if cn.err != nil || len(cn.wbuf) == 0 {
				cn.writing = false
				cn.mu.Unlock()
				break
			}
			buf := cn.wbuf
			cn.wbuf = spare[:0]
			cn.writing = true
			cn.mu.Unlock()
			_ = cn.nc.SetWriteDeadline(time.Now().Add(writeTimeout))
			cn.stats.writes.Add(1)
			if _, err := cn.nc.Write(buf); err != nil {
				cn.fail(&ConnError{Err: err})
				return
			}
			spare = nil
			if cap(buf) <= maxSpare {
				spare = buf[:0]
			}
		}
	}
}

// wait returns cl's reply. A call whose context ends first is abandoned
// (its reply will be dropped); if no reply at all arrived on the
// connection since the call was queued, and none for AbortSilentAfter,
// the server is treated as down and the connection aborted (see abort), so
// the commands still queued to it do not run later. (A server that still
// answers, only late, or a reader that ran late on a busy client, keeps
// the connection and the other calls on it.)
func (cn *conn) wait(ctx context.Context, cl *call) (Value, error) {
	select {
	case <-cl.done:
	case <-ctx.Done():
		select {
		case <-cl.done:
		default:
			err := &ConnError{Err: fmt.Errorf("no reply: %w", ctx.Err())}
			now := time.Now().UnixNano()
			cn.mu.Lock()
			silent := cn.replies == cl.seen && now-cn.lastReply >= cn.abortSilent
			cn.mu.Unlock()
			if silent {
				cn.abort(err)
			}
			return Value{}, err
		}
	}
	v, err := cl.v, cl.err
	putCall(cl)
	return v, err
}

// abort breaks the connection with a TCP reset instead of a close: the
// commands the server has not read yet (a frozen server, e.g. SIGSTOP)
// are discarded with the connection instead of running when it resumes,
// long after their callers were told they failed.
func (cn *conn) abort(err error) {
	nc := cn.nc
	if tc, ok := nc.(*tls.Conn); ok {
		nc = tc.NetConn()
	}
	if tc, ok := nc.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	cn.fail(err)
}

// readLoop reads replies and hands each to the oldest waiting call.
func (cn *conn) readLoop() {
	for {
		v, err := readValue(cn.br, 0)
		if err != nil {
			if _, ok := err.(Error); !ok { //nolint:errorlint // readValue returns Error itself, never wrapped
				cn.fail(&ConnError{Err: err})
				return
			}
		}
		cn.mu.Lock()
		if cn.qhead >= len(cn.q) {
			cn.mu.Unlock()
			cn.fail(&ConnError{Err: fmt.Errorf("%w: reply without a command", errProtocol)})
			return
		}
		cl := cn.q[cn.qhead]
		cn.q[cn.qhead] = nil
		cn.qhead++
		cn.replies++
		cn.lastReply = time.Now().UnixNano()
		switch {
		case cn.qhead == len(cn.q):
			cn.q, cn.qhead = cn.q[:0], 0
		case cn.qhead >= 1024 && cn.qhead*2 >= len(cn.q):
			k := copy(cn.q, cn.q[cn.qhead:])
			clear(cn.q[k:])
			cn.q, cn.qhead = cn.q[:k], 0
		}
		cn.mu.Unlock()
		cl.v, cl.err = v, err
		cl.done <- struct{}{}
	}
}

// fail breaks the connection once: it is closed and every call awaiting
// a reply fails with err.
func (cn *conn) fail(err error) {
	cn.mu.Lock()
	if cn.err != nil {
		cn.mu.Unlock()
		return
	}
	cn.err = err
	cn.broken.Store(true)
	close(cn.dead)
	q := cn.q[cn.qhead:]
	cn.q, cn.qhead = nil, 0
	cn.wbuf = nil
	cn.mu.Unlock()
	_ = cn.nc.Close()
	for _, cl := range q {
		cl.err = err
		cl.done <- struct{}{}
	}
}
