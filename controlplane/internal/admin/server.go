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
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/keyring"
	"github.com/sluicegw/sluice/internal/token"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

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
	// code ("ok" on success) and duration (for metrics).
	Observe func(procedure, code string, d time.Duration)
}

// Server implements every admin service.
type Server struct {
	store     *store.Store
	peppers   *token.Peppers
	bootstrap string
	keys      *keyring.Ring
	log       *slog.Logger
	observe   func(procedure, code string, d time.Duration)
}

// NewHandler returns the admin API as one http.Handler (all services).
func NewHandler(o Options) http.Handler {
	s := &Server{store: o.Store, peppers: o.Peppers, bootstrap: o.BootstrapToken, keys: o.KeyRing, log: o.Logger, observe: o.Observe}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	opts := connect.WithInterceptors(s.interceptor())
	mux := http.NewServeMux()
	mux.Handle(adminv1connect.NewOrgServiceHandler(&orgService{s}, opts))
	mux.Handle(adminv1connect.NewTeamServiceHandler(&teamService{Server: s}, opts))
	mux.Handle(adminv1connect.NewUserServiceHandler(&userService{Server: s}, opts))
	mux.Handle(adminv1connect.NewKeyServiceHandler(&keyService{Server: s}, opts))
	mux.Handle(adminv1connect.NewCustomerServiceHandler(&customerService{Server: s}, opts))
	mux.Handle(adminv1connect.NewAdminTokenServiceHandler(&adminTokenService{s}, opts))
	mux.Handle(adminv1connect.NewAuditServiceHandler(&auditService{s}, opts))
	mux.Handle(adminv1connect.NewFleetServiceHandler(&fleetService{s}, opts))
	mux.Handle(adminv1connect.NewRolloutServiceHandler(&rolloutService{s}, opts))
	mux.Handle(adminv1connect.NewSpendServiceHandler(&spendService{s}, opts))
	mux.Handle(adminv1connect.NewAlertServiceHandler(&alertService{s}, opts))
	mux.Handle(adminv1connect.NewModelServiceHandler(&modelService{s}, opts))
	return mux
}

// RequestIDHeader carries the request id on every answer.
const RequestIDHeader = "X-Sluice-Request-Id"

var requestIDPattern = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,100}$`)

type requestIDKey struct{}

func requestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	return id
}

func newRequestID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return "req_" + hex.EncodeToString(b[:])
}

// interceptor authenticates the caller, tracks that the handler
// authorised the call, maps errors and logs one line per call.
func (s *Server) interceptor() connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			start := time.Now()
			rid := req.Header().Get("X-Request-Id")
			if !requestIDPattern.MatchString(rid) {
				rid = newRequestID()
			}
			ctx = context.WithValue(ctx, requestIDKey{}, rid)
			procedure := req.Spec().Procedure
			p, err := s.authenticate(ctx, req.Header().Get("Authorization"))
			var resp connect.AnyResponse
			if err == nil && p.Role < authz.RoleEditor && mutating(req.Spec()) {
				// Viewers never mutate: refuse before the handler looks
				// anything up, so the answer does not depend on the target.
				err = connect.NewError(connect.CodePermissionDenied, errors.New("role viewer may not call "+procedure))
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
			attrs := []any{"procedure", procedure, "request_id", rid, "duration_ms", time.Since(start).Milliseconds()}
			if p != nil {
				attrs = append(attrs, "principal", p.ID)
			}
			if cerr != nil {
				attrs = append(attrs, "code", cerr.Code().String())
			} else {
				attrs = append(attrs, "code", "ok")
			}
			s.log.InfoContext(ctx, "admin rpc", attrs...)
			if s.observe != nil {
				code := "ok"
				if cerr != nil {
					code = cerr.Code().String()
				}
				s.observe(procedure, code, time.Since(start))
			}
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
		t, err := s.store.AdminTokenByHash(ctx, c.Hash)
		if errors.Is(err, store.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		now := s.store.Now()
		if t.RevokedAt != nil {
			return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("admin token has been revoked"))
		}
		if t.ExpiresAt != nil && !now.Before(*t.ExpiresAt) {
			return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("admin token has expired"))
		}
		p := &authz.Principal{ID: t.ID, Name: t.Name, Scope: t.Scope, OrgID: t.OrgID, TeamID: t.TeamID, Role: t.Role}
		if t.ExpiresAt != nil {
			p.Expires = *t.ExpiresAt
		}
		return p, nil
	}
	return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("unknown admin token"))
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
