package main

import (
	"context"
	"flag"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

var orgColumns = []column[*adminv1.Org]{
	{"ID", (*adminv1.Org).GetId},
	{"NAME", (*adminv1.Org).GetName},
	{"BLOCKED", func(o *adminv1.Org) string { return yesNo(o.GetBlocked()) }},
	{"LIMITS", func(o *adminv1.Org) string { return limitsSummary(o.GetLimits()) }},
	{"CREATED", func(o *adminv1.Org) string { return formatTime(o.GetCreateTime()) }},
}

// orgFields registers the settable fields of an org.
func orgFields(f *fields, o *adminv1.Org) {
	f.String(&o.Name, "name", "name", "org name, unique on the platform (1–100 characters)")
	f.Limits(&o.Limits, limitsBasic)
	f.Metadata(&o.Metadata)
}

func orgCommand() *command {
	return group("org", "manage organisations", []*command{
		leaf("create", "[NAME]", "create an org (needs a platform token)", runOrgCreate),
		idCommand("get", "ORG", "show an org", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.orgs.GetOrg, &adminv1.GetOrgRequest{Id: id})
			return r.GetOrg(), err
		}),
		listCommand("", "list orgs", orgColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.Org] {
			req := &adminv1.ListOrgsRequest{}
			fs.StringVar(&req.NamePrefix, "name-prefix", "", "only orgs whose name starts with this")
			fs.Var(&optBool{&req.Blocked}, "blocked", "only blocked (--blocked) or unblocked (--blocked=false) orgs")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.Org, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.orgs.ListOrgs, req)
				return r.GetOrgs(), r.GetNextPageToken(), err
			}
		}),
		updateCommand("org", func() *adminv1.Org { return &adminv1.Org{} }, orgFields,
			func(ctx context.Context, c *clients, id string, o *adminv1.Org, mask *fieldmaskpb.FieldMask) (*adminv1.Org, error) {
				o.Id = id
				r, err := call(ctx, c.orgs.UpdateOrg, &adminv1.UpdateOrgRequest{Org: o, UpdateMask: mask})
				return r.GetOrg(), err
			}),
		deleteCommand("org", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			return call(ctx, c.orgs.DeleteOrg, &adminv1.DeleteOrgRequest{Id: id})
		}),
		idCommand("block", "ORG", "block an org: every key in it is rejected (403)", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.orgs.BlockOrg, &adminv1.BlockOrgRequest{Id: id})
			return r.GetOrg(), err
		}),
		idCommand("unblock", "ORG", "unblock an org", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.orgs.UnblockOrg, &adminv1.UnblockOrgRequest{Id: id})
			return r.GetOrg(), err
		}),
	}, "orgs")
}

func runOrgCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	o := &adminv1.Org{}
	orgFields(newFields(fs), o)
	if err := a.parseNamed(fs, c, &o.Name, "name"); err != nil {
		return err
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.orgs.CreateOrg, &adminv1.CreateOrgRequest{Name: o.Name, Limits: o.Limits, Metadata: o.Metadata})
	return p.result(r.GetOrg(), err)
}
