// Package admin serves the Connect admin API (package sluice.admin.v1):
// authentication of admin tokens, authorisation of every RPC against the
// token's scope, validation, and the mapping of errors to Connect codes.
package admin

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/keyring"
	"github.com/sluicegw/sluice/internal/token"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// DefaultMaxRequestBytes bounds one admin request body (and the decoded
// message, after decompression). The largest legitimate requests (a key
// with every map and list field full, a deployment with its credential)
// are a few tens of KiB; 4 MiB leaves room for generous metadata while
// keeping a request's memory small.
const DefaultMaxRequestBytes = 4 << 20

// Options configures the admin API.
type Options struct {
	Store   *store.Store
	Peppers *token.Peppers
	// BootstrapToken is the platform-admin token from SLUICE_ADMIN_TOKEN;
	// empty disables it.
	BootstrapToken string
	// KeyRing seals upstream credentials of deployments before they are
	// stored (SLUICE_KEK); nil refuses to store credentials.
	KeyRing *keyring.Ring
	Logger  *slog.Logger
	// Observe, if set, is called once per RPC with its procedure, Connect
	// code ("ok" on success) and duration (for metrics). Requests for an
	// unknown procedure are observed as "" so labels stay bounded.
	Observe func(procedure, code string, d time.Duration)
	// MaxRequestBytes bounds a request body and its decoded message
	// (DefaultMaxRequestBytes if 0).
	MaxRequestBytes int
	// NATS reaches the data planes (ExplainService); nil answers explain
	// requests with unavailable.
	NATS *nats.Conn
}

// Server implements every admin service.
type Server struct {
	store      *store.Store
	peppers    *token.Peppers
	bootstrap  string
	keys       *keyring.Ring
	log        *slog.Logger
	observe    func(procedure, code string, d time.Duration)
	maxBytes   int
	procedures map[string]bool
	errw       *connect.ErrorWriter
	// verifySlots bounds the audit verifications running at once (see
	// VerifyAuditChain).
	verifySlots chan struct{}
	nc          *nats.Conn
}

// NewHandler returns the admin API as one http.Handler (all services).
//
// Requests pass two stages. The HTTP gate (gate) runs before anything
// reads the body: it refuses a declared Content-Length above the limit,
// authenticates the bearer token from the Authorization header and caps
// the body reader, so an unauthenticated caller costs no more than its
// headers. Only then does the Connect handler read and decode the
// message (itself bounded by connect.WithReadMaxBytes), and the
// interceptor checks roles, the text of every string field, and maps
// errors.
func NewHandler(o Options) http.Handler { return newServer(o).handler() }

func newServer(o Options) *Server {
	s := &Server{store: o.Store, peppers: o.Peppers, bootstrap: o.BootstrapToken, keys: o.KeyRing, log: o.Logger, observe: o.Observe,
		maxBytes: o.MaxRequestBytes, procedures: adminProcedures(), errw: connect.NewErrorWriter(),
		verifySlots: make(chan struct{}, maxConcurrentVerifications), nc: o.NATS}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.maxBytes <= 0 {
		s.maxBytes = DefaultMaxRequestBytes
	}
	return s
}

// handler is the admin API of s: every service behind the gate.
func (s *Server) handler() http.Handler {
	opts := connect.WithHandlerOptions(connect.WithInterceptors(s.interceptor()), connect.WithReadMaxBytes(s.maxBytes),
		// Decoding like the defaults, naming fields with invalid UTF-8.
		connect.WithCodec(textProtoCodec{}), connect.WithCodec(textJSONCodec{name: "json"}),
		connect.WithCodec(textJSONCodec{name: "json; charset=utf-8"}))
	mux := http.NewServeMux()
	mux.Handle(adminv1connect.NewOrgServiceHandler(&orgService{s}, opts))
	mux.Handle(adminv1connect.NewTeamServiceHandler(&teamService{Server: s}, opts))
	mux.Handle(adminv1connect.NewUserServiceHandler(&userService{Server: s}, opts))
	mux.Handle(adminv1connect.NewKeyServiceHandler(&keyService{Server: s}, opts))
	mux.Handle(adminv1connect.NewCustomerServiceHandler(&customerService{Server: s}, opts))
	mux.Handle(adminv1connect.NewLabelScopeServiceHandler(&labelScopeService{Server: s}, opts))
	mux.Handle(adminv1connect.NewIssuerServiceHandler(&issuerService{Server: s}, opts))
	mux.Handle(adminv1connect.NewAdminTokenServiceHandler(&adminTokenService{s}, opts))
	mux.Handle(adminv1connect.NewAuditServiceHandler(&auditService{s}, opts))
	mux.Handle(adminv1connect.NewFleetServiceHandler(&fleetService{s}, opts))
	mux.Handle(adminv1connect.NewRolloutServiceHandler(&rolloutService{s}, opts))
	mux.Handle(adminv1connect.NewSpendServiceHandler(&spendService{s}, opts))
	mux.Handle(adminv1connect.NewAlertServiceHandler(&alertService{s}, opts))
	mux.Handle(adminv1connect.NewModelServiceHandler(&modelService{s}, opts))
	mux.Handle(adminv1connect.NewTrafficServiceHandler(&trafficService{s}, opts))
	mux.Handle(adminv1connect.NewExplainServiceHandler(&explainService{s}, opts))
	return s.gate(mux)
}

// adminProcedures returns every procedure of package sluice.admin.v1
// ("/sluice.admin.v1.KeyService/CreateKey").
func adminProcedures() map[string]bool {
	out := map[string]bool{}
	protoregistry.GlobalFiles.RangeFilesByPackage("sluice.admin.v1", func(fd protoreflect.FileDescriptor) bool {
		for i := 0; i < fd.Services().Len(); i++ {
			sd := fd.Services().Get(i)
			for j := 0; j < sd.Methods().Len(); j++ {
				out["/"+string(sd.FullName())+"/"+string(sd.Methods().Get(j).Name())] = true
			}
		}
		return true
	})
	return out
}

// RequestIDHeader carries the request id on every answer.
const RequestIDHeader = "X-Sluice-Request-Id"

var requestIDPattern = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,100}$`)

type requestIDKey struct{}

// authnKey carries the principal the gate authenticated.
type authnKey struct{}

func requestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	return id
}

func newRequestID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return "req_" + hex.EncodeToString(b[:])
}

// callerRequestID is the caller's X-Request-Id if it is well-formed, or a
// new id.
func callerRequestID(h http.Header) string {
	if rid := h.Get("X-Request-Id"); requestIDPattern.MatchString(rid) {
		return rid
	}
	return newRequestID()
}

// gate authenticates a request from its headers before the body is read.
// A declared body above the limit is ResourceExhausted and a missing or
// bad token Unauthenticated, both answered in the request's protocol
// (Connect, gRPC or gRPC-Web) without reading a byte of the body; the
// server then closes an HTTP/1.1 connection whose body is left unread.
// Accepted requests get a body reader capped just above the limit, so
// even a body without Content-Length (chunked, HTTP/2) is cut off there.
func (s *Server) gate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rid := callerRequestID(r.Header)
		ctx := context.WithValue(r.Context(), requestIDKey{}, rid)
		procedure := r.URL.Path
		if !s.procedures[procedure] {
			procedure = "" // not a label value: any path reaches the gate
		}
		var err error
		var p *authz.Principal
		if r.ContentLength > int64(s.maxBytes) {
			err = connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
				"request body of %d bytes is larger than the admin API's limit of %d bytes", r.ContentLength, s.maxBytes))
		} else if p, err = s.authenticate(ctx, r.Header.Get("Authorization")); err == nil {
			// One byte over the limit so that Connect's own check answers
			// with the size; its attempt to drain the rest stops here. A
			// copy of the request: the server must still see its own body
			// to close a connection whose body was left unread or failed.
			r2 := r.WithContext(context.WithValue(ctx, authnKey{}, p))
			r2.Body = http.MaxBytesReader(w, r.Body, int64(s.maxBytes)+1)
			next.ServeHTTP(w, r2)
			return
		}
		cerr := s.toConnect(ctx, procedure, err)
		cerr.Meta().Set(RequestIDHeader, rid)
		if werr := s.errw.Write(w, r, cerr); werr != nil {
			s.log.DebugContext(ctx, "write admin error", "request_id", rid, "error", werr)
		}
		s.finish(ctx, procedure, rid, nil, cerr, start)
	})
}

// finish logs one line per call and observes it.
func (s *Server) finish(ctx context.Context, procedure, rid string, p *authz.Principal, cerr *connect.Error, start time.Time) {
	code := "ok"
	if cerr != nil {
		code = cerr.Code().String()
	}
	attrs := []any{"procedure", procedure, "request_id", rid, "duration_ms", time.Since(start).Milliseconds(), "code", code}
	if p != nil {
		attrs = append(attrs, "principal", p.ID)
	}
	s.log.InfoContext(ctx, "admin rpc", attrs...)
	if s.observe != nil {
		s.observe(procedure, code, time.Since(start))
	}
}

// interceptor takes the caller the gate authenticated, refuses viewers'
// mutations and text no column can hold, tracks that the handler
// authorised the call, maps errors and logs one line per call.
func (s *Server) interceptor() connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			start := time.Now()
			rid := requestID(ctx)
			if rid == "" {
				rid = callerRequestID(req.Header())
				ctx = context.WithValue(ctx, requestIDKey{}, rid)
			}
			procedure := req.Spec().Procedure
			var err error
			p, _ := ctx.Value(authnKey{}).(*authz.Principal)
			if p == nil { // not behind the gate
				p, err = s.authenticate(ctx, req.Header().Get("Authorization"))
			}
			var resp connect.AnyResponse
			if err == nil && p.Role < authz.RoleEditor && mutating(req.Spec()) {
				// Viewers never mutate: refuse before the handler looks
				// anything up, so the answer does not depend on the target.
				err = connect.NewError(connect.CodePermissionDenied, errors.New("role viewer may not call "+procedure))
			}
			if err == nil {
				// Postgres text cannot hold NUL and every column is UTF-8:
				// refuse such text here, naming the field, for every RPC.
				if msg, ok := req.Any().(proto.Message); ok {
					err = checkText(msg)
				}
			}
			if err == nil {
				ctx = authz.WithPrincipal(ctx, p)
				var checked func() bool
				ctx, checked = authz.WithCheckTracking(ctx)
				resp, err = next(ctx, req)
				if err == nil && !checked() {
					s.log.ErrorContext(ctx, "handler answered without an authorisation check", "procedure", procedure)
					resp, err = nil, errors.New("handler did not authorise the call")
				}
			}
			cerr := s.toConnect(ctx, procedure, err)
			if cerr != nil {
				cerr.Meta().Set(RequestIDHeader, rid)
			} else if resp != nil {
				resp.Header().Set(RequestIDHeader, rid)
			}
			s.finish(ctx, procedure, rid, p, cerr, start)
			if cerr != nil {
				return nil, cerr
			}
			return resp, nil
		}
	}
}

// mutating reports whether an RPC changes state: every RPC not marked
// idempotency_level = NO_SIDE_EFFECTS in the proto.
func mutating(spec connect.Spec) bool {
	md, ok := spec.Schema.(protoreflect.MethodDescriptor)
	if !ok {
		return true // unknown: treat as mutating (fail closed)
	}
	opts, _ := md.Options().(*descriptorpb.MethodOptions)
	return opts.GetIdempotencyLevel() != descriptorpb.MethodOptions_NO_SIDE_EFFECTS
}

// authenticate resolves the bearer token to a principal.
func (s *Server) authenticate(ctx context.Context, header string) (*authz.Principal, error) {
	raw, ok := strings.CutPrefix(header, "Bearer ")
	if !ok || raw == "" {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("missing bearer token (Authorization: Bearer <admin token>)"))
	}
	if s.bootstrap != "" && subtle.ConstantTimeCompare([]byte(raw), []byte(s.bootstrap)) == 1 {
		return &authz.Principal{ID: authz.BootstrapID, Name: "bootstrap", Scope: authz.ScopePlatform, Role: authz.RoleAdmin}, nil
	}
	if err := token.Check(token.AdminPrefix, raw); err != nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("admin token is malformed or mistyped"))
	}
	for _, c := range s.peppers.Candidates(raw) {
		chain, err := s.store.AdminTokenChainByHash(ctx, c.Hash)
		if errors.Is(err, store.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return principalFromChain(chain, s.store.Now())
	}
	return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("unknown admin token"))
}

// principalFromChain is the principal of chain[0], a token followed by
// its issuers up to the bootstrap token (see store.AdminTokenChainByHash).
// A token is only as alive as the tokens that minted it: it is refused
// once any issuer is revoked or expired, or missing, and its effective
// expiry (Principal.Expires) is the earliest along the chain.
func principalFromChain(chain []store.AdminToken, now time.Time) (*authz.Principal, error) {
	t := chain[0]
	if t.RevokedAt != nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("admin token has been revoked"))
	}
	if t.ViaPrevious && (t.PreviousValidUntil == nil || !now.Before(*t.PreviousValidUntil)) {
		// A secret rotated out: refused once its grace is over (the hash
		// stays stored until the next rotation, never accepted again).
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("admin token has been rotated; this secret's grace period is over"))
	}
	if t.ExpiresAt != nil && !now.Before(*t.ExpiresAt) {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("admin token has expired"))
	}
	var expires time.Time
	for i, a := range chain {
		if i > 0 {
			switch {
			case a.RevokedAt != nil:
				return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("admin token is no longer valid: a token it was created with has been revoked"))
			case a.ExpiresAt != nil && !now.Before(*a.ExpiresAt):
				return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("admin token is no longer valid: a token it was created with has expired"))
			}
		}
		if a.ExpiresAt != nil && (expires.IsZero() || a.ExpiresAt.Before(expires)) {
			expires = *a.ExpiresAt
		}
	}
	if chain[len(chain)-1].CreatedBy != authz.BootstrapID {
		// An issuer is gone (tokens are deleted only once revoked, with
		// their org) or the chain is implausibly long: fail closed.
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("admin token is no longer valid: a token it was created with no longer exists"))
	}
	return &authz.Principal{ID: t.ID, Name: t.Name, Scope: t.Scope, OrgID: t.OrgID, TeamID: t.TeamID, Role: t.Role, Expires: expires}, nil
}

// toConnect maps an error to a Connect error. Messages of internal errors
// are logged, never returned.
func (s *Server) toConnect(ctx context.Context, procedure string, err error) *connect.Error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	var ve *ValidationError
	if errors.As(err, &ve) {
		return connect.NewError(connect.CodeInvalidArgument, ve)
	}
	var se *store.Error
	if errors.As(err, &se) {
		switch {
		case errors.Is(err, store.ErrNotFound):
			return connect.NewError(connect.CodeNotFound, errors.New(se.Msg))
		case errors.Is(err, store.ErrAlreadyExists):
			return connect.NewError(connect.CodeAlreadyExists, errors.New(se.Msg))
		case errors.Is(err, store.ErrFailedPrecondition):
			return connect.NewError(connect.CodeFailedPrecondition, errors.New(se.Msg))
		}
	}
	if errors.Is(err, authz.ErrDenied) {
		return connect.NewError(connect.CodePermissionDenied, err)
	}
	// The caller's own context first: pgconn reports a done context as
	// "safe to retry", which is not the database's fault.
	if ctx.Err() == nil && store.IsUnavailable(err) {
		s.log.WarnContext(ctx, "admin rpc: database unavailable", "procedure", procedure, "request_id", requestID(ctx), "error", err)
		return connect.NewError(connect.CodeUnavailable, errors.New("the database is unavailable; retry later (request id "+requestID(ctx)+")"))
	}
	if errors.Is(err, context.Canceled) {
		return connect.NewError(connect.CodeCanceled, errors.New("request canceled"))
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return connect.NewError(connect.CodeDeadlineExceeded, errors.New("deadline exceeded"))
	}
	s.log.ErrorContext(ctx, "admin rpc internal error", "procedure", procedure, "request_id", requestID(ctx), "error", err)
	return connect.NewError(connect.CodeInternal, errors.New("internal error (request id "+requestID(ctx)+")"))
}

// actor returns the audit actor of ctx's principal.
func actor(ctx context.Context) store.Actor {
	p := authz.FromContext(ctx)
	a := store.Actor{RequestID: requestID(ctx)}
	if p != nil {
		a.ID = p.ID
		if p.ID != authz.BootstrapID {
			a.TokenID = p.ID
		} else {
			a.TokenID = authz.BootstrapID
		}
	}
	return a
}

// principal returns ctx's principal (never nil inside a handler).
func principal(ctx context.Context) *authz.Principal { return authz.FromContext(ctx) }

// tenant returns the store tenant filter of ctx's principal.
func tenant(ctx context.Context) store.Tenant {
	f := authz.FilterFor(principal(ctx))
	return store.Tenant{OrgID: f.OrgID, TeamID: f.TeamID}
}
