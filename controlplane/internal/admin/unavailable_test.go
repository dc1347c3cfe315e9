package admin

import (
	"context"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// tcpProxy forwards connections to Postgres until Cut, which closes the
// listener and every forwarded connection: the database becomes
// unreachable (refused) and open connections die under their queries.
type tcpProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  []net.Conn
	wg     sync.WaitGroup
}

// startTCPProxy listens on addr ("127.0.0.1:0" for any port).
func startTCPProxy(t *testing.T, addr, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	require.NoError(t, err)
	p := &tcpProxy{ln: ln, target: target}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, up)
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); _, _ = io.Copy(up, c); up.Close() }()
			go func() { defer p.wg.Done(); _, _ = io.Copy(c, up); c.Close() }()
		}
	}()
	t.Cleanup(p.Cut)
	return p
}

func (p *tcpProxy) Addr() string { return p.ln.Addr().String() }

// Cut makes the database unreachable through p.
func (p *tcpProxy) Cut() {
	_ = p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
}

// allRPCsAnswerUnavailable calls every admin RPC (from the descriptors)
// as the platform admin and requires Unavailable: every one needs the
// database, except WhoAmI, which describes the caller only.
func allRPCsAnswerUnavailable(t *testing.T, b *bundle, o objs) {
	t.Helper()
	for _, r := range adminRPCs(t) {
		code, out := b.callJSON(b.bootstrap, r.procedure, builders[r.method](o))
		if r.method == "WhoAmI" {
			require.Equal(t, "ok", code, "%s: %s", r.procedure, out)
			continue
		}
		require.Equal(t, "unavailable", code, "%s: %s", r.procedure, out)
		require.Contains(t, string(out), "database is unavailable", r.procedure)
		require.NotContains(t, string(out), "127.0.0.1", "no connection details in answers")
	}
}

// TestPostgresUnreachableIsUnavailable: with the database cut off (its
// connections killed, new ones refused), every admin RPC answers
// Unavailable (retryable) rather than Internal, and so does
// authenticating a database token; once it is back, they work again.
func TestPostgresUnreachableIsUnavailable(t *testing.T) {
	t.Parallel()
	direct := testsvc.NewDatabase(t)
	u, err := url.Parse(direct)
	require.NoError(t, err)
	proxy := startTCPProxy(t, "127.0.0.1:0", u.Host)
	viaProxy := *u
	viaProxy.Host = proxy.Addr()
	cfg, err := pgxpool.ParseConfig(viaProxy.String())
	require.NoError(t, err)
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	b := setupOn(t, pool, direct)
	fx := b.mkFixture("down")
	orgTok := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, fx.team1.OrgID, "")
	code, out := b.callJSON(orgTok, "/sluice.admin.v1.OrgService/GetOrg", `{"id":"`+fx.team1.OrgID+`"}`)
	require.Equal(t, "ok", code, "%s", out)

	proxy.Cut()
	allRPCsAnswerUnavailable(t, b, fx.team1)
	code, out = b.callJSON(orgTok, "/sluice.admin.v1.OrgService/GetOrg", `{"id":"`+fx.team1.OrgID+`"}`)
	require.Equal(t, "unavailable", code, "authenticating a database token: %s", out)
	require.Contains(t, b.logs.String(), "database unavailable", "the cause is logged")

	// Back: a new proxy on the same address.
	startTCPProxy(t, proxy.Addr(), u.Host)
	code, out = b.callJSON(orgTok, "/sluice.admin.v1.OrgService/GetOrg", `{"id":"`+fx.team1.OrgID+`"}`)
	require.Equal(t, "ok", code, "recovers once the database is back: %s", out)
}

// TestPostgresDatabaseGoneIsUnavailable: the database is dropped with
// FORCE under the control plane (its backends terminated, 57P01, and
// reconnecting fails): Unavailable, never Internal.
func TestPostgresDatabaseGoneIsUnavailable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fx := b.mkFixture("gone")
	// Hold a few connections open in the pool so that some calls meet a
	// terminated backend and others a failed reconnect.
	ctx := context.Background()
	var conns []*pgxpool.Conn
	for i := 0; i < 3; i++ {
		c, err := b.pool.Acquire(ctx)
		require.NoError(t, err)
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	admin, err := pgx.Connect(ctx, testsvc.AdminURL())
	require.NoError(t, err)
	defer admin.Close(ctx)
	name := b.dbURL[strings.LastIndex(b.dbURL, "/")+1:]
	if i := strings.IndexByte(name, '?'); i >= 0 {
		name = name[:i]
	}
	_, err = admin.Exec(ctx, `DROP DATABASE `+pgx.Identifier{name}.Sanitize()+` WITH (FORCE)`)
	require.NoError(t, err)
	allRPCsAnswerUnavailable(t, b, fx.team1)
}
