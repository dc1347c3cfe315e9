package main

import (
	"context"
	"flag"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

var userColumns = []column[*adminv1.User]{
	{"ID", (*adminv1.User).GetId},
	{"ORG", (*adminv1.User).GetOrgId},
	{"EMAIL", (*adminv1.User).GetEmail},
	{"NAME", (*adminv1.User).GetDisplayName},
	{"BLOCKED", func(u *adminv1.User) string { return yesNo(u.GetBlocked()) }},
	{"LIMITS", func(u *adminv1.User) string { return limitsSummary(u.GetLimits()) }},
	{"CREATED", func(u *adminv1.User) string { return formatTime(u.GetCreateTime()) }},
}

// userFields registers the settable fields of a user.
func userFields(f *fields, u *adminv1.User) {
	f.String(&u.Email, "email", "email", "e-mail address, unique in the org")
	f.String(&u.DisplayName, "display-name", "display_name", "display name")
	f.Limits(&u.Limits, limitsBasic)
	f.Metadata(&u.Metadata)
}

func userCommand() *command {
	return group("user", "manage users", []*command{
		leaf("create", "[EMAIL]", "create a user", runUserCreate),
		idCommand("get", "USER", "show a user", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.users.GetUser, &adminv1.GetUserRequest{Id: id})
			return r.GetUser(), err
		}),
		listCommand("", "list users", userColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.User] {
			req := &adminv1.ListUsersRequest{}
			fs.StringVar(&req.OrgId, "org", "", "only users of this org")
			fs.StringVar(&req.EmailPrefix, "email-prefix", "", "only users whose e-mail starts with this")
			fs.Var(&optBool{&req.Blocked}, "blocked", "only blocked (--blocked) or unblocked (--blocked=false) users")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.User, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.users.ListUsers, req)
				return r.GetUsers(), r.GetNextPageToken(), err
			}
		}),
		updateCommand("user", func() *adminv1.User { return &adminv1.User{} }, userFields,
			func(ctx context.Context, c *clients, id string, o *adminv1.User, mask *fieldmaskpb.FieldMask) (*adminv1.User, error) {
				o.Id = id
				r, err := call(ctx, c.users.UpdateUser, &adminv1.UpdateUserRequest{User: o, UpdateMask: mask})
				return r.GetUser(), err
			}),
		deleteCommand("user", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			return call(ctx, c.users.DeleteUser, &adminv1.DeleteUserRequest{Id: id})
		}),
		idCommand("block", "USER", "block a user: keys it owns or uses are rejected (403)", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.users.BlockUser, &adminv1.BlockUserRequest{Id: id})
			return r.GetUser(), err
		}),
		idCommand("unblock", "USER", "unblock a user", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.users.UnblockUser, &adminv1.UnblockUserRequest{Id: id})
			return r.GetUser(), err
		}),
	}, "users")
}

func runUserCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	u := &adminv1.User{}
	fs.StringVar(&u.OrgId, "org", "", "org of the user (default: the token's org; required with a platform token)")
	userFields(newFields(fs), u)
	if err := a.parseNamed(fs, c, &u.Email, "email"); err != nil {
		return err
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.users.CreateUser, &adminv1.CreateUserRequest{
		OrgId: u.OrgId, Email: u.Email, DisplayName: u.DisplayName, Limits: u.Limits, Metadata: u.Metadata,
	})
	return p.result(r.GetUser(), err)
}
